"""What the CPU this process runs on can do: model name, feature flags, and the dtype to run in.

``cpu_flags()`` are the CPU's flags as capped by ``PAGEDATTN_CPU_ISA`` (pagedattn.envs): with
``avx2`` the AVX-512 and AMX flags are hidden, so every choice made from them (the dtype, the
kernel candidates, the extension's build) is the one an AVX2 machine makes. ``isa_levels()``
lists the levels this CPU can execute, for building and testing each one.
``cpu_signature()`` names the CPU for caches of measured choices (the kernel tuner's); two machines
with the same model name and flags share one. ``resolve_dtype("auto", device)`` is bfloat16 where
the CPU has bf16 hardware (AVX512-BF16 or AMX-BF16) and float32 elsewhere; on CUDA it is bfloat16
where the GPU supports it, else float16.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import torch

from pagedattn import envs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# Flags worth naming when a report says what the machine can do.
NOTABLE_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
_CPUINFO = Path("/proc/cpuinfo")


@functools.lru_cache(maxsize=1)
def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo ({} where unreadable)."""
    fields: dict[str, str] = {}
    try:
        text = _CPUINFO.read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # NOTE: every processor repeats the same block; the first one is enough
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


# The flags each x86-64 level needs (x86-64-v3: AVX2 and FMA; x86-64-v4: AVX-512 F/BW/CD/DQ/VL).
ISA_REQUIRED_FLAGS = {
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
}
# The flags a cap hides: everything past the level (AMX and the bf16/fp16 AVX-512 extensions
# are not part of x86-64-v4).
_PAST_AVX512 = ("amx", "avx512_bf16", "avx512_fp16")
_PAST_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert")
_PAST_SCALAR = ("avx", "fma", "f16c", "amx")


def hardware_flags() -> frozenset[str]:
    """The CPU's own feature flags (``flags`` in /proc/cpuinfo; empty where there is none)."""
    return frozenset(_cpuinfo_fields().get("flags", "").split())


def _hidden(flag: str, cap: str) -> bool:
    past = {"avx512": _PAST_AVX512, "avx2": _PAST_AVX2, "scalar": _PAST_SCALAR}.get(cap, ())
    return flag.startswith(past)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as this process may use them (PAGEDATTN_CPU_ISA hides those past
    its level)."""
    cap = envs.PAGEDATTN_CPU_ISA
    flags = hardware_flags()
    if cap == "native":
        return flags
    return frozenset(f for f in flags if not _hidden(f, cap))


def isa_levels() -> list[str]:
    """The levels this CPU can execute, lowest first: ``scalar``, then ``avx2``, ``avx512``
    where it has their flags, and ``native`` (what the compiler's -march=native targets)."""
    flags = hardware_flags()
    levels = ["scalar"]
    if ISA_REQUIRED_FLAGS["avx2"] <= flags:
        levels.append("avx2")
        if ISA_REQUIRED_FLAGS["avx512"] <= flags:
            levels.append("avx512")
    return [*levels, "native"]


def isa_level() -> str:
    """The level this process runs at: PAGEDATTN_CPU_ISA, lowered to what the CPU can execute
    (``native`` means the CPU's own flags, AMX included)."""
    cap = envs.PAGEDATTN_CPU_ISA
    if cap not in isa_levels():
        raise ValueError(
            f"PAGEDATTN_CPU_ISA={cap} asks for instructions this CPU lacks: it runs "
            f"{', '.join(isa_levels())}"
        )
    return cap


def vector_isa() -> str:
    """The widest vector instructions this process uses, for reports: amx, avx512, avx2,
    neon or scalar."""
    flags = cpu_flags()
    if platform.machine() in ("aarch64", "arm64"):
        return "neon"
    if {"amx_tile", "amx_bf16"} <= flags:
        return "amx"
    if ISA_REQUIRED_FLAGS["avx512"] <= flags:
        return "avx512"
    if ISA_REQUIRED_FLAGS["avx2"] <= flags:
        return "avx2"
    return "scalar"


def cpu_model_name() -> str:
    """The CPU's model name, e.g. ``Intel(R) Xeon(R) Processor`` (the platform's where unknown)."""
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def notable_flags() -> list[str]:
    """The vector and matrix flags this CPU has, in NOTABLE_FLAGS order."""
    flags = cpu_flags()
    return [f for f in NOTABLE_FLAGS if f in flags]


_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The size of the largest data cache cpu0 sees (its L3 on x86; 0 where sysfs does not say).

    NOTE: on a shared host it is the whole socket's (480 MiB on one Xeon seen here), more than a
    small model's weights: what a decode step streams may come from this cache, not memory.
    """
    best = 0
    for index in sorted(_CACHE_DIR.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        if kind == "Instruction" or not size:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def cpu_signature() -> str:
    """A short stable id of this CPU kind: hash of model name, all flags, and the thread count."""
    key = f"{cpu_model_name()}|{' '.join(sorted(cpu_flags()))}|{torch.get_num_threads()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def describe_cpu(threads: int | None = None) -> str:
    """One line for reports: model name, threads (default: torch's) and the notable flags (and
    the ISA cap, where PAGEDATTN_CPU_ISA sets one)."""
    flags = " ".join(notable_flags()) or "no AVX2/AVX-512"
    threads = torch.get_num_threads() if threads is None else threads
    cap = envs.PAGEDATTN_CPU_ISA
    capped = "" if cap == "native" else f" (capped to {cap} by PAGEDATTN_CPU_ISA)"
    return f"{cpu_model_name()}; {threads} threads; {flags}{capped}"


def has_bf16_hardware() -> bool:
    """True where the CPU computes bf16 products natively (AVX512-BF16 or AMX-BF16)."""
    return any(f in cpu_flags() for f in BF16_FLAGS)


def has_int8_dot_hardware() -> bool:
    """True where the CPU has int8 dot-product instructions (VNNI or AMX-INT8)."""
    return any(f in cpu_flags() for f in INT8_DOT_FLAGS)


def has_amx() -> bool:
    """True where the CPU has AMX tiles with bf16 support."""
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype a ``--dtype`` value means on ``device``; "auto" picks what runs fast there.

    auto: on CPU bfloat16 with bf16 hardware (avx512_bf16 or amx_bf16), else float32; on CUDA
    bfloat16 where supported, else float16. Raises ValueError for an unknown name.
    """
    if name != "auto":
        if name not in DTYPES:
            allowed = ", ".join(["auto", *DTYPES])
            raise ValueError(f"dtype={name!r} is invalid: use one of {allowed}")
        return DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return torch.bfloat16 if bf16 else torch.float16
    return torch.bfloat16 if has_bf16_hardware() else torch.float32
