"""Every environment variable pagedattn reads, with its default and meaning (as vLLM's envs.py).

Nothing else in the package reads ``os.environ`` for its own settings: ``envs.PAGEDATTN_CPU_ISA``
reads the variable when the attribute is read, so a test's ``monkeypatch.setenv`` takes effect.
Switches that change what the engine computes or which kernel runs are config fields
(``ModelConfig.linear_kernel``, ``attention_kernel``, ``decode_stack``, ``step_ops``), not
variables; the variables below say where files go, what this process may use of the CPU, and
the server's keys. ``pagedattn env`` prints them with their current values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

# Values PAGEDATTN_CPU_ISA accepts, from the most capable down (see pagedattn.cpu.features).
CPU_ISA_LEVELS = ("native", "avx512", "avx2", "scalar")


class EnvVar(NamedTuple):
    """One variable: how its value is read, and what it means."""

    read: Callable[[], Any]
    doc: str
    secret: bool = False  # never printed


def _flag(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _text(name: str, default: str = "") -> Callable[[], str]:
    return lambda: os.environ.get(name, default).strip()


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDATTN_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "pagedattn")


def _ext_dir() -> Path:
    root = os.environ.get("PAGEDATTN_EXT_DIR")
    if root:
        return Path(root)
    # NOTE: not under PAGEDATTN_CACHE_DIR: a private cache of plans and metadata (as tests give
    # each process) must not cost a minute-long rebuild of the same extension.
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "pagedattn", "ext")


def _cpu_isa() -> str:
    value = os.environ.get("PAGEDATTN_CPU_ISA", "native").strip().lower() or "native"
    if value not in CPU_ISA_LEVELS:
        raise ValueError(
            f"PAGEDATTN_CPU_ISA={value!r} is invalid: use one of {', '.join(CPU_ISA_LEVELS)}"
        )
    return value


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    "PAGEDATTN_CACHE_DIR": EnvVar(
        _cache_dir,
        "Where measured and converted files are kept (kernel plans, GGUF metadata and weights, "
        "the benchmarks' synthetic checkpoints under synthetic/): "
        "default $XDG_CACHE_HOME/pagedattn, else ~/.cache/pagedattn.",
    ),
    "PAGEDATTN_EXT_DIR": EnvVar(
        _ext_dir,
        "Where the compiled CPU extension is built and cached, one folder per ISA level, CPU and "
        "source hash (default: $XDG_CACHE_HOME/pagedattn/ext, else ~/.cache/pagedattn/ext).",
    ),
    "PAGEDATTN_CPU_ISA": EnvVar(
        _cpu_isa,
        "Caps the CPU instruction set this process uses, as PyTorch's ATEN_CPU_CAPABILITY does: "
        "native (default), avx512 (x86-64-v4, no AMX or bf16 instructions), avx2 (x86-64-v3) or "
        "scalar. The extension is built for that level and the CPU's flags above it are hidden, "
        "so an AVX-512 machine runs as an AVX2 machine would. `import pagedattn` also caps "
        "PyTorch, oneDNN and MKL to the same level when they have not been set. Benchmark "
        "children and peer engines also get pagedattn.cpu.cpuid_cap's preload library, which "
        "reads this variable and answers their CPUID as the capped CPU would.",
    ),
    "PAGEDATTN_DISABLE_CPU_EXT": EnvVar(
        _flag("PAGEDATTN_DISABLE_CPU_EXT"),
        "1: never build or load the compiled CPU extension; every kernel runs on PyTorch.",
    ),
    "PAGEDATTN_RETUNE": EnvVar(
        _flag("PAGEDATTN_RETUNE"),
        "1: measure the kernel plan again instead of reading the cached one.",
    ),
    "PAGEDATTN_WEIGHT_CACHE": EnvVar(
        lambda: os.environ.get("PAGEDATTN_WEIGHT_CACHE", "1").strip() != "0",
        "0: do not keep dequantised GGUF weights on disk (default 1: keep them, so a repeat "
        "start maps them instead of dequantising again).",
    ),
    "PAGEDATTN_CPU_BIND": EnvVar(
        _text("PAGEDATTN_CPU_BIND", "auto"),
        "CPU sets of Ray Serve replicas sharing a node (--data-parallel-size, --prefill-replicas) "
        "and of tensor-parallel ranks on one NUMA node: auto (default: with T threads, replica "
        "slot or rank s runs on CPUs s*T..(s+1)*T-1 of the node when they all fit), off, or one "
        "list per slot, e.g. 0-3|4-7 (as vLLM's VLLM_CPU_OMP_THREADS_BIND).",
    ),
    "PAGEDATTN_TRACE_HOPS": EnvVar(
        _flag("PAGEDATTN_TRACE_HOPS"),
        "1: streamed events carry SSE comment lines (': hop ...') with the monotonic times at "
        "which the engine made the token, the server's event loop read it and the Ray Serve "
        "ingress forwarded it (`bench pd --trace-hops`; clients ignore comment lines).",
    ),
    "PAGEDATTN_API_KEY": EnvVar(
        _text("PAGEDATTN_API_KEY"),
        "Comma-separated API keys of the OpenAI server when --api-key is not given.",
        secret=True,
    ),
    "PAGEDATTN_ADMIN_API_KEY": EnvVar(
        _text("PAGEDATTN_ADMIN_API_KEY"),
        "Comma-separated admin API keys when --admin-api-key is not given: also API keys, and "
        "the only keys internal endpoints (/debug/replicas, /debug/router) accept.",
        secret=True,
    ),
    "PAGEDATTN_TENANT_SALT_SECRET": EnvVar(
        _text("PAGEDATTN_TENANT_SALT_SECRET"),
        "The server's secret that each API key's prefix-cache salt is derived from (HMAC): the "
        "same value across restarts and servers lets a tenant's blocks in --kv-store be found "
        "again; unset, each server start draws a random one (store hits do not survive it).",
        secret=True,
    ),
    "PAGEDATTN_TP_AUTHKEY": EnvVar(
        _text("PAGEDATTN_TP_AUTHKEY"),
        "Set by the tensor-parallel executor for the rank processes it starts (hex): the key of "
        "their control connection. Not a user setting; a rank removes it from its environment "
        "on start (take_tp_authkey).",
        secret=True,
    ),
}


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(ENVIRONMENT_VARIABLES)


def take_tp_authkey() -> bytes:
    """PAGEDATTN_TP_AUTHKEY as bytes, removed from the environment (children do not inherit it)."""
    return bytes.fromhex(os.environ.pop("PAGEDATTN_TP_AUTHKEY"))


def describe() -> list[tuple[str, str, str]]:
    """(name, value now or "(unset)", meaning) for every variable (a secret shows as "(set)")."""
    rows = []
    for name, var in ENVIRONMENT_VARIABLES.items():
        value = os.environ.get(name)
        shown = "(unset)" if value is None else "(set)" if var.secret else value
        rows.append((name, shown, var.doc))
    return rows


# PAGEDATTN_CPU_ISA level -> the variables that cap PyTorch, oneDNN and MKL at the same level.
_LIBRARY_CAPS = {
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "scalar": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
}


def apply_cpu_isa_cap() -> dict[str, str]:
    """Cap PyTorch, oneDNN and MKL to PAGEDATTN_CPU_ISA where they are not set already.

    NOTE: each library reads its variable once, on first use; ``import pagedattn`` calls this
    before any kernel has run. A process that ran torch kernels first keeps its own ISA there.
    Returns the variables set.
    """
    caps = _LIBRARY_CAPS.get(_cpu_isa(), {})
    applied = {}
    for name, value in caps.items():
        if name not in os.environ:
            os.environ[name] = value
            applied[name] = value
    return applied
