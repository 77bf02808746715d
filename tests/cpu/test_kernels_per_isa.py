"""The kernel tests against every ISA level this CPU executes, each in a process of its own.

A process loads one build of the extension (its pybind types register once), so each level runs
the kernel test modules in a subprocess with ``PAGEDATTN_CPU_ISA=<level>``: the AVX2 code is
tested on an AVX-512 machine too. ``native`` is what the rest of the suite loads in-process.
Each build is cached per level under PAGEDATTN_EXT_DIR (scripts/setup.sh builds native, avx2 and
avx512), so a repeat run only loads it. avx2 and avx512 run in the default suite; scalar (the
correctness-only fallback, which no target machine runs) needs a build of its own and runs with
``-m slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedattn.cpu import features

ROOT = Path(__file__).resolve().parents[2]
# Paged decode (GQA, sliding window, soft-cap, fp32/bf16, fp8 and u8 caches, partitions), paged
# prefill, the step ops, the panel GEMM, the LoRA kernel, the GGUF block kernels and the fused
# MoE block.
KERNEL_TESTS = (
    "tests/cpu/test_extension.py",
    "tests/cpu/test_extension_fp8.py",
    "tests/cpu/test_extension_u8.py",
    "tests/attention/backends/test_step_ops_cpu.py",
    "tests/attention/backends/test_prefill_cpu.py",
    "tests/cpu/test_panel_gemm.py",
    "tests/cpu/test_lora_kernel.py",
    "tests/cpu/test_quant_kernels.py",
    "tests/cpu/test_moe_kernel.py",
)
DEFAULT_LEVELS = ("avx2", "avx512")
# The vector ISA each level's build reports (ext.isa()).
EXPECTED_ISA = {"avx512": "avx512", "avx2": "avx2", "scalar": "scalar"}


def levels() -> list:
    params = []
    for level in features.isa_levels():
        if level == "native":
            continue
        marks = [] if level in DEFAULT_LEVELS else [pytest.mark.slow]
        params.append(pytest.param(level, marks=marks, id=level))
    return params


def run_at(level: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PAGEDATTN_CPU_ISA": level}
    # NOTE: the parent's caps (ATEN_CPU_CAPABILITY ...) were set for its own level.
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("level", levels())
def test_kernels_at_level(level):
    probe = run_at(
        level,
        "-c",
        "from pagedattn.cpu import extension as e; m = e.load_extension(); "
        "print(m.isa(), m.vector_width(), m.linear_packed_vectorized(), m.linear_amx_available())",
    )
    assert probe.returncode == 0, probe.stderr[-4000:]
    isa, width, vectorized, amx = probe.stdout.split()[-4:]
    assert isa == EXPECTED_ISA[level]
    assert vectorized == str(level != "scalar") and amx == "False"
    result = run_at(level, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS)
    assert result.returncode == 0, f"{level} (vectors of {width}):\n{result.stdout[-6000:]}"
