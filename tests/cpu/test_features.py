"""cpu_features reads /proc/cpuinfo's flags; --dtype auto follows the bf16 hardware flags."""

from __future__ import annotations

import pytest
import torch

from pagedattn.cpu import features as cpu_features

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Test CPU 9000
flags\t\t: fpu sse2 avx2 avx512f {extra}

processor\t: 1
model name\t: Test CPU 9000
flags\t\t: fpu sse2 avx2 avx512f {extra}
"""


@pytest.fixture
def fake_cpu(monkeypatch, tmp_path):
    """Point cpu_features at a written cpuinfo file; returns a function that sets its flags.
    The fake CPU runs uncapped (a PAGEDATTN_CPU_ISA of the whole run would hide its flags)."""
    monkeypatch.delenv("PAGEDATTN_CPU_ISA", raising=False)

    def write(extra: str) -> None:
        path = tmp_path / "cpuinfo"
        path.write_text(CPUINFO.format(extra=extra))
        monkeypatch.setattr(cpu_features, "_CPUINFO", path)
        cpu_features._cpuinfo_fields.cache_clear()

    yield write
    cpu_features._cpuinfo_fields.cache_clear()


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("", torch.float32),
        ("avx512_vnni", torch.float32),
        ("avx512_bf16", torch.bfloat16),  # Zen 4/5, Cooper Lake
        ("amx_tile amx_bf16 amx_int8", torch.bfloat16),  # Sapphire Rapids and later
    ],
)
def test_auto_dtype_follows_bf16_hardware(fake_cpu, extra, expected):
    fake_cpu(extra)
    assert cpu_features.resolve_dtype("auto", "cpu") == expected
    assert cpu_features.has_bf16_hardware() == (expected == torch.bfloat16)


def test_explicit_dtypes_are_kept_and_unknown_ones_rejected(fake_cpu):
    fake_cpu("amx_bf16")
    assert cpu_features.resolve_dtype("float32", "cpu") == torch.float32
    assert cpu_features.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='fp8' is invalid: use one of auto, float32"):
        cpu_features.resolve_dtype("fp8", "cpu")


def test_signature_and_description_change_with_the_flags(fake_cpu):
    fake_cpu("")
    plain = cpu_features.cpu_signature()
    assert cpu_features.cpu_model_name() == "Test CPU 9000"
    assert "amx" not in cpu_features.describe_cpu()
    fake_cpu("amx_tile amx_bf16")
    assert cpu_features.cpu_signature() != plain
    assert cpu_features.has_amx()
    assert cpu_features.describe_cpu().endswith("avx2 avx512f amx_tile amx_bf16")


def test_missing_cpuinfo_means_no_flags(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_features, "_CPUINFO", tmp_path / "absent")
    cpu_features._cpuinfo_fields.cache_clear()
    try:
        assert cpu_features.cpu_flags() == frozenset()
        assert cpu_features.resolve_dtype("auto", "cpu") == torch.float32
        assert cpu_features.cpu_model_name()  # the platform's name instead
    finally:
        cpu_features._cpuinfo_fields.cache_clear()
