"""CPUID as a smaller CPU answers it, for processes whose kernels pagedattn does not choose.

``PAGEDATTN_CPU_ISA`` caps pagedattn's own extension and, through their variables, PyTorch,
oneDNN and MKL. A peer engine may read CPUID itself and pick AVX-512 or AMX kernels regardless
(OpenVINO's MLAS matmuls do), which made its figures under the cap those of the bigger CPU.
``capped_env`` gives a child process the preload library of ``csrc/preload/cpuid_cap.c``: with
Linux's CPUID faulting it answers every CPUID in that process with the features above the cap
removed, and a glibc tunable keeps glibc's own string functions at the same level.

It needs an x86-64 Linux CPU that lists ``cpuid_fault`` and a C compiler; elsewhere
``capped_env`` returns the environment unchanged with the reason, for the report.

    python -m pagedattn.cpu.cpuid_cap                       # build it and print its path
    python -m pagedattn.cpu.cpuid_cap avx2 -- CMD [ARGS...]  # run CMD as an AVX2 CPU would
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from pagedattn import envs
from pagedattn.cpu import features

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "preload" / "cpuid_cap.c"
LIBRARY_NAME = "libcpuid_cap.so"
# glibc reads CPUID before any preloaded library runs; its tunable drops the same features from
# its own choice of memcpy/strlen variants and of the x86-64-v4 library folders.
_PAST_AVX2_HWCAPS = "-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD"
GLIBC_HWCAPS = {"avx2": _PAST_AVX2_HWCAPS, "scalar": f"{_PAST_AVX2_HWCAPS},-AVX2,-AVX,-FMA"}


class CpuidCapError(RuntimeError):
    """The preload library cannot cap CPUID on this machine."""


def unavailable_reason() -> str | None:
    """Why CPUID cannot be capped here, or None when it can."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return (
            f"CPUID faulting is an x86-64 Linux feature ({platform.system()} {platform.machine()})"
        )
    if "cpuid_fault" not in features.hardware_flags():
        return "this CPU (or its hypervisor) does not offer CPUID faulting (no cpuid_fault flag)"
    if _compiler() is None:
        return "no C compiler (cc) to build the preload library"
    return None


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def library() -> Path:
    """The built preload library (compiled once per source into PAGEDATTN_EXT_DIR)."""
    reason = unavailable_reason()
    if reason:
        raise CpuidCapError(reason)
    digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
    out = envs.PAGEDATTN_EXT_DIR / f"cpuid_cap-{digest}" / LIBRARY_NAME
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{LIBRARY_NAME}.{os.getpid()}")
    cmd = [_compiler(), "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise CpuidCapError(f"building {SOURCE.name} failed: {proc.stderr.strip()[-500:]}")
    os.replace(tmp, out)  # NOTE: never a half-written file under the published name
    return out


def capped_env(env: dict[str, str], level: str | None = None) -> tuple[dict[str, str], str]:
    """``env`` for a child process that sees CPUID capped to ``level`` (default: this process's
    PAGEDATTN_CPU_ISA), and one line saying what the child sees.

    ``native`` returns ``env`` as it is; where the cap cannot be had, so does every level, and the
    line gives the reason.
    """
    level = envs.PAGEDATTN_CPU_ISA if level is None else level
    if level == "native":
        return env, "CPUID uncapped"
    try:
        path = library()
    except CpuidCapError as exc:
        return env, f"CPUID uncapped: {exc}"
    # NOTE: a child of a capped child gets the same env again: nothing is added twice.
    preloads = env.get("LD_PRELOAD", "").split()
    capped = env | {
        "PAGEDATTN_CPU_ISA": level,
        "LD_PRELOAD": " ".join(dict.fromkeys([str(path), *preloads])),
    }
    hwcaps = GLIBC_HWCAPS.get(level)
    if hwcaps:
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        capped["GLIBC_TUNABLES"] = ":".join(
            dict.fromkeys([*tunables, f"glibc.cpu.hwcaps={hwcaps}"])
        )
    return capped, f"CPUID capped to {level}"


def main(argv: list[str]) -> int:
    """Print the library's path; or, given ``LEVEL -- CMD ...``, run CMD under PAGEDATTN_CPU_ISA
    =LEVEL with its CPUID capped (where the CPUID cap cannot be had, CMD still runs, capped by
    PAGEDATTN_CPU_ISA alone, and the reason is printed)."""
    if not argv:
        print(library())
        return 0
    if len(argv) < 3 or argv[1] != "--" or argv[0] not in envs.CPU_ISA_LEVELS:
        levels = "|".join(envs.CPU_ISA_LEVELS)
        print(
            f"usage: python -m pagedattn.cpu.cpuid_cap [{levels} -- CMD [ARGS...]]", file=sys.stderr
        )
        return 2
    env, line = capped_env(dict(os.environ), argv[0])
    env["PAGEDATTN_CPU_ISA"] = argv[0]
    print(f"cpuid_cap: {line}: {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    os.execvpe(argv[2], argv[2:], env)
    return 1  # NOTE: not reached; execvpe raises where the command cannot run


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
