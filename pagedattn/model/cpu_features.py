"""What the CPU this process runs on can do: model name, feature flags, and the dtype to run in.

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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``flags`` in /proc/cpuinfo; empty where there is no such file)."""
    return frozenset(_cpuinfo_fields().get("flags", "").split())


def cpu_model_name() -> str:
    """The CPU's model name, e.g. ``Intel(R) Xeon(R) Processor`` (the platform's where unknown)."""
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def notable_flags() -> list[str]:
    """The vector and matrix flags this CPU has, in NOTABLE_FLAGS order."""
    flags = cpu_flags()
    return [f for f in NOTABLE_FLAGS if f in flags]


def cpu_signature() -> str:
    """A short stable id of this CPU kind: hash of model name, all flags, and the thread count."""
    key = f"{cpu_model_name()}|{' '.join(sorted(cpu_flags()))}|{torch.get_num_threads()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def describe_cpu(threads: int | None = None) -> str:
    """One line for reports: model name, threads (default: torch's) and the notable flags."""
    flags = " ".join(notable_flags()) or "no AVX2/AVX-512"
    threads = torch.get_num_threads() if threads is None else threads
    return f"{cpu_model_name()}; {threads} threads; {flags}"


def has_bf16_hardware() -> bool:
    """True where the CPU computes bf16 products natively (AVX512-BF16 or AMX-BF16)."""
    return any(f in cpu_flags() for f in BF16_FLAGS)


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
