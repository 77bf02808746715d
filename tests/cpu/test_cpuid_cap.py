"""cpuid_cap: a child process sees CPUID as the capped CPU answers it, and still crashes as before.

The preload library needs CPUID faulting (the ``cpuid_fault`` flag) and a C compiler; those tests
skip where the CPU lacks it, with the reason. The environment it builds is tested everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedattn.benchmarks import peers_cpu_engines
from pagedattn.cpu import cpuid_cap, features

REASON = cpuid_cap.unavailable_reason()
needs_faulting = pytest.mark.skipif(REASON is not None, reason=f"no CPUID cap here: {REASON}")
TORCH_CAPABILITY = "import torch; print(torch.backends.cpu.get_cpu_capability())"
# A child that executes CPUID itself (leaf, subleaf from argv) and prints EAX EBX ECX EDX: the
# machine code of f(leaf, subleaf, out) in executable memory.
RAW_CPUID = """
import ctypes, mmap, sys
code = bytes.fromhex(
    "53" "4989d0" "89f8" "89f1" "0fa2" "418900" "41895804" "41894808" "4189500c" "5b" "c3"
)
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
cpuid = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)(address)
out = (ctypes.c_uint32 * 4)()
cpuid(int(sys.argv[1]), int(sys.argv[2]), ctypes.addressof(out))
print(*out)
"""


def _child_env(level: str) -> dict[str, str]:
    """This process's environment capped to ``level``, without the variables that cap PyTorch
    on their own (the child must learn its level from CPUID alone)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "LD_PRELOAD")}
    env, line = cpuid_cap.capped_env(env, level)
    assert line == f"CPUID capped to {level}"
    return env


def _run(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    # NOTE: -X faulthandler installs Python's own SIGSEGV handler, as pytest does in its workers.
    cmd = [sys.executable, "-X", "faulthandler", "-c", code, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)


@needs_faulting
@pytest.mark.parametrize(
    ("level", "capability"),
    [("scalar", "DEFAULT"), ("avx2", "AVX2")],
)
def test_pytorch_in_a_capped_child_reads_the_capped_cpuid(level, capability):
    if level == "avx2" and "avx2" not in features.hardware_flags():
        pytest.skip("the CPU has no AVX2")
    proc = _run(TORCH_CAPABILITY, _child_env(level))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == capability


def _leaf7(env: dict[str, str]) -> tuple[int, int, int, int]:
    proc = _run(RAW_CPUID, env, "7", "0")
    assert proc.returncode == 0, proc.stderr
    return tuple(int(v) for v in proc.stdout.split())


def _bit(register: int, n: int) -> bool:
    return bool(register >> n & 1)


@needs_faulting
def test_cpuid_leaf_7_loses_exactly_the_features_above_the_level():
    """Bits of leaf 7 (EBX: AVX2 5, AVX512F 16, AVX512BW 30, AVX512VL 31; EDX: AMX-BF16 22,
    AMX-TILE 24) as /proc/cpuinfo lists them uncapped, then under each cap."""
    flags = features.hardware_flags()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    _, ebx, _, edx = _leaf7(env)
    assert _bit(ebx, 5) == ("avx2" in flags)
    assert _bit(ebx, 16) == ("avx512f" in flags)
    assert _bit(edx, 24) == ("amx_tile" in flags)
    _, ebx, _, edx = _leaf7(_child_env("avx512"))
    assert (_bit(ebx, 16), _bit(ebx, 30), _bit(ebx, 31)) == (("avx512f" in flags),) * 3
    assert not _bit(edx, 22) and not _bit(edx, 24)
    _, ebx, ecx, edx = _leaf7(_child_env("avx2"))
    assert _bit(ebx, 5) == ("avx2" in flags)
    assert ebx & 0xDC230000 == 0  # AVX512 F, DQ, IFMA, PF, ER, CD, BW, VL
    assert ecx & 0x5842 == 0  # AVX512 VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ
    assert edx & 0x03C0010C == 0  # AVX512 4VNNIW, 4FMAPS, VP2INTERSECT, FP16; AMX
    _, ebx, _, _ = _leaf7(_child_env("scalar"))
    assert not _bit(ebx, 5)


@needs_faulting
def test_an_uncapped_child_reads_the_real_cpuid():
    # NOTE: without this run's own cap (make test-isa runs the suite under the library).
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "LD_PRELOAD")}
    env, line = cpuid_cap.capped_env(env, "native")
    assert line == "CPUID uncapped" and "LD_PRELOAD" not in env
    proc = _run(TORCH_CAPABILITY, env)
    expected = "AVX512" if "avx512f" in features.hardware_flags() else "AVX2"
    assert proc.stdout.split()[-1] == expected


@needs_faulting
def test_a_real_segfault_still_reaches_the_programs_own_handler():
    """Python's faulthandler was installed after the library's handler; a fault that is not a
    CPUID must reach it (and kill the process with SIGSEGV), not loop or vanish."""
    proc = _run("import ctypes; ctypes.string_at(0)", _child_env("avx2"))
    assert proc.returncode == -11
    assert "Segmentation fault" in proc.stderr


def test_the_capped_environment_adds_the_library_once(monkeypatch, tmp_path):
    library = tmp_path / "libcpuid_cap.so"
    monkeypatch.setattr(cpuid_cap, "library", lambda: library)
    env = {"LD_PRELOAD": "/opt/other.so", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    once, line = cpuid_cap.capped_env(env, "avx2")
    twice, _ = cpuid_cap.capped_env(once, "avx2")
    assert line == "CPUID capped to avx2"
    assert once == twice
    assert once["LD_PRELOAD"] == f"{library} /opt/other.so"
    assert once["PAGEDATTN_CPU_ISA"] == "avx2"
    assert once["GLIBC_TUNABLES"].startswith("glibc.malloc.arena_max=2:glibc.cpu.hwcaps=-AVX512F")
    assert cpuid_cap.capped_env(env, "native") == (env, "CPUID uncapped")


def test_without_faulting_the_environment_is_unchanged_and_says_why(monkeypatch):
    monkeypatch.setattr(cpuid_cap, "unavailable_reason", lambda: "no cpuid_fault flag")
    env = {"PATH": "/usr/bin"}
    assert cpuid_cap.capped_env(env, "avx2") == (env, "CPUID uncapped: no cpuid_fault flag")


def test_a_peer_of_a_capped_run_gets_the_capped_cpuid(monkeypatch, tmp_path):
    library = tmp_path / "libcpuid_cap.so"
    monkeypatch.setattr(cpuid_cap, "library", lambda: library)
    monkeypatch.setenv("PAGEDATTN_CPU_ISA", "avx2")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert peers_cpu_engines._peer_env()["LD_PRELOAD"] == str(library)
    monkeypatch.setenv("PAGEDATTN_CPU_ISA", "native")
    assert "LD_PRELOAD" not in peers_cpu_engines._peer_env()


@needs_faulting
def test_the_command_line_runs_a_command_on_the_capped_cpu():
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "LD_PRELOAD")}
    cmd = [sys.executable, "-m", "pagedattn.cpu.cpuid_cap", "avx2", "--", sys.executable]
    cmd += [
        "-c",
        TORCH_CAPABILITY.replace("print(", "print(__import__('os').environ['PAGEDATTN_CPU_ISA'], "),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["avx2", "AVX2"]
    assert "CPUID capped to avx2" in proc.stderr
    bad = subprocess.run(
        [*cmd[:3], "avx9", "--", "true"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "usage" in bad.stderr
