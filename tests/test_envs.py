"""Every environment variable is read in pagedattn/envs.py, and the ISA cap hides what it should."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedattn import envs
from pagedattn.config import ModelConfig
from pagedattn.cpu import features
from pagedattn.cpu.linear import LINEAR_KERNELS
from pagedattn.cpu.plan import ATTENTION_KERNELS

PACKAGE = Path(envs.__file__).parent
# Reading the environment is envs.py's job; these only set variables or hand them on.
ALLOWED = {"envs.py"}
READ = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[|os\.environ\.pop\(")
NAME = re.compile(r"PAGEDATTN_[A-Z0-9_]+")


def test_no_module_but_envs_reads_the_environment():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name in ALLOWED:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if READ.search(line) and "setdefault" not in line:
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    # NOTE: the Ray ingress hands PAGEDATTN_*/HF_* variables on to its replicas, and the
    # benchmarks hand PYTHONPATH and the peers' own variables on to their subprocesses.
    offenders = [o for o in offenders if "serve_app.py" not in o and "benchmarks/" not in o]
    assert offenders == []


def test_every_pagedattn_variable_the_package_names_is_listed():
    named = {m for path in PACKAGE.rglob("*.py") for m in NAME.findall(path.read_text())}
    assert named - set(envs.ENVIRONMENT_VARIABLES) == set()


def test_every_variable_is_documented_and_secrets_are_not_printed(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_API_KEY", "sk-secret")
    rows = {name: (value, doc) for name, value, doc in envs.describe()}
    assert set(rows) == set(envs.ENVIRONMENT_VARIABLES) and all(d for _, d in rows.values())
    assert rows["PAGEDATTN_API_KEY"][0] == "(set)"
    out = subprocess.run(
        [sys.executable, "-m", "pagedattn.cli", "env"],
        capture_output=True,
        text=True,
        check=True,
        env={"PAGEDATTN_API_KEY": "sk-secret", "PATH": "/usr/bin:/bin"},
    ).stdout
    assert "PAGEDATTN_CPU_ISA" in out and "sk-secret" not in out


def test_kernel_choices_of_the_config_are_the_registries():
    fields = ModelConfig.__dataclass_fields__
    # NOTE: gguf runs the layers that keep GGUF blocks: the weights' format picks it, not
    # --linear-kernel (which chooses among the float and int8 kernels).
    assert set(fields["linear_kernel"].metadata["choices"]) == {"auto", *LINEAR_KERNELS} - {"gguf"}
    assert set(fields["attention_kernel"].metadata["choices"]) == {"auto", *ATTENTION_KERNELS}


def test_isa_cap_hides_the_flags_past_its_level(monkeypatch):
    monkeypatch.delenv("PAGEDATTN_CPU_ISA", raising=False)  # the fake CPU starts uncapped
    monkeypatch.setattr(
        features,
        "hardware_flags",
        lambda: frozenset(
            {
                "avx",
                "avx2",
                "fma",
                "f16c",
                "bmi1",
                "bmi2",
                "movbe",
                "avx512f",
                "avx512bw",
                "avx512cd",
                "avx512dq",
                "avx512vl",
                "avx512_bf16",
                "amx_tile",
                "amx_bf16",
                "avx_vnni",
            }
        ),
    )
    assert features.isa_levels() == ["scalar", "avx2", "avx512", "native"]
    assert features.vector_isa() == "amx" and features.has_bf16_hardware()
    monkeypatch.setenv("PAGEDATTN_CPU_ISA", "avx512")
    assert features.vector_isa() == "avx512" and not features.has_bf16_hardware()
    monkeypatch.setenv("PAGEDATTN_CPU_ISA", "avx2")
    assert features.vector_isa() == "avx2" and not features.has_amx()
    assert not any(f.startswith("avx512") for f in features.cpu_flags())
    assert "PAGEDATTN_CPU_ISA" in features.describe_cpu()
    monkeypatch.setenv("PAGEDATTN_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="PAGEDATTN_CPU_ISA='avx9' is invalid"):
        features.isa_level()


def test_a_level_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(features, "hardware_flags", lambda: frozenset({"sse4_2"}))
    monkeypatch.setenv("PAGEDATTN_CPU_ISA", "avx2")
    with pytest.raises(ValueError, match="asks for instructions this CPU lacks"):
        features.isa_level()


def test_the_cap_reaches_torch_onednn_and_mkl():
    code = (
        "import pagedattn, os; "
        "print(os.environ['ATEN_CPU_CAPABILITY'], os.environ['ONEDNN_MAX_CPU_ISA'])"
    )
    env = {"PAGEDATTN_CPU_ISA": "avx2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.split() == ["avx2", "AVX2"], out.stderr
