"""The compiled CPU extension (pagedattn/csrc): build and load it for this CPU's ISA level.

One library holds every compiled kernel: paged decode attention (paged_attention_cpu.cpp), the
panel, AVX512-BF16 and AMX GEMMs (linear_cpu.cpp, linear_dpbf16_cpu.cpp, linear_amx_cpu.cpp),
the per-layer step ops (step_ops_cpu.cpp: cache write, rotary, RMSNorm, SwiGLU/GeGLU, argmax),
the decode stack and the fused MoE block (moe_cpu.cpp). The sources are written over ATen's
``at::vec::Vectorized`` (the AVX512-BF16 and AMX kernels on intrinsics) and compiled for one
ISA level (``BUILD_FLAGS``): ``avx2`` (x86-64-v3), ``avx512`` (x86-64-v4), ``native``
(-march=native: AVX512-BF16 and AMX where the CPU has them) or ``scalar``; the level is
``features.isa_level()``, i.e. the CPU's own unless ``PAGEDATTN_CPU_ISA`` caps it. The first
use builds it with ``torch.utils.cpp_extension.load`` (about a minute) under
``PAGEDATTN_EXT_DIR``, one folder per level, CPU and source hash; later processes load the
cached library in well under a second.
``PAGEDATTN_DISABLE_CPU_EXT=1`` turns all compiled code off. If the build fails,
``get_extension`` logs why once and returns None, and callers keep the PyTorch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from pagedattn import envs
from pagedattn.cpu import features

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCE = CSRC / "paged_attention_cpu.cpp"
SOURCES = (
    SOURCE,
    CSRC / "linear_cpu.cpp",
    CSRC / "linear_amx_cpu.cpp",
    CSRC / "linear_dpbf16_cpu.cpp",
    CSRC / "step_ops_cpu.cpp",
    CSRC / "decode_stack_cpu.cpp",
    CSRC / "moe_cpu.cpp",
    CSRC / "kv_gather_cpu.cpp",
    CSRC / "shm_collectives_cpu.cpp",
    CSRC / "lora_cpu.cpp",
    CSRC / "quant_cpu.cpp",
    CSRC / "bindings_cpu.cpp",
)
# NOTE: -ffp-contract=off: the kernels fuse a multiply and an add only where they call fmadd, so
# every ISA rounds at the same points (the rotation must round after each product, as PyTorch).
COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
# ISA level -> compiler flags. CPU_CAPABILITY_* selects at::vec::Vectorized's implementation,
# as PyTorch's own per-ISA builds of its CPU kernels do.
BUILD_FLAGS = {
    "native": ["-march=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native", "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-march=x86-64-v3", "-mtune=native", "-DCPU_CAPABILITY_AVX2"],
    "scalar": ["-march=x86-64-v2", "-mtune=native"],
}
AARCH64_FLAGS = ["-march=armv8.2-a+fp16+bf16"]
EXTENSION_NAME = "pagedattn_cpu_ext"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Caches paged_decode reads beside float32/bfloat16 queries (the FP8 KV cache).
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Quantized caches paged_decode reads beside float32/bfloat16 queries: fp8 and u8 (attention.u8).
QUANTIZED_CACHE_DTYPES = (*FP8_CACHE_DTYPES, torch.uint8)
# Tokens per work item of long contexts; shorter rows are one item (merged by log-sum-exp).
DEFAULT_PARTITION_SIZE = 512
# Kernel sentinels for "no sliding window" and "no soft-cap".
NO_SLIDING_WINDOW = 0
NO_SOFT_CAP = 0.0
HEAD_SIZE_MULTIPLE = 16


def build_flags(isa: str) -> list[str]:
    """The compiler flags of one ISA level (``native`` adds the at::vec capability the CPU's
    flags allow, so -march=native code and ATen's vectors agree)."""
    if platform.machine() in ("aarch64", "arm64"):
        return [*COMMON_FLAGS, *AARCH64_FLAGS]
    if isa not in BUILD_FLAGS:
        raise ValueError(f"ISA level {isa!r} is invalid: use one of {', '.join(BUILD_FLAGS)}")
    flags = [*COMMON_FLAGS, *BUILD_FLAGS[isa]]
    if isa == "native":
        levels = features.isa_levels()
        if "avx512" in levels:
            flags.append("-DCPU_CAPABILITY_AVX512")
        elif "avx2" in levels:
            flags.append("-DCPU_CAPABILITY_AVX2")
    return flags


# Debian's cross compiler (g++-aarch64-linux-gnu), for checking that the sources compile for ARM.
AARCH64_CROSS_COMPILER = "aarch64-linux-gnu-g++"


def aarch64_syntax_check_command(source: Path, compiler: str = AARCH64_CROSS_COMPILER) -> list[str]:
    """The command that compile-checks one source for aarch64 (NEON, at::vec's vec128) with this
    torch's headers, without linking: the kernels must build on ARM, not only on x86."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    return [
        compiler,
        "-std=c++17",
        "-fsyntax-only",
        *COMMON_FLAGS,
        *AARCH64_FLAGS,
        f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}",
        *(f"-I{path}" for path in includes),
        str(source),
    ]


class ExtensionBuildError(RuntimeError):
    """The C++ paged-attention extension could not be compiled or loaded."""


# The library loaded in this process and its level (one per process: the bindings register
# their C++ types once), or why it could not be had.
_module: ModuleType | None = None
_module_isa: str | None = None
_error: str | None = None


def _cpu_tag() -> str:
    """A short hash of the CPU's own flags (a native build runs only on CPUs like this one)."""
    flags = " ".join(sorted(features.hardware_flags())) or platform.machine()
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def build_key(isa: str) -> str:
    """A short hash of what the build depends on: sources, headers, flags, torch version."""
    digest = hashlib.sha1(f"{build_flags(isa)}|{torch.__version__}".encode())
    for path in sorted(CSRC.glob("*.[ch]*")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def build_dir(isa: str) -> Path:
    """Where the build of ``isa`` for this CPU and these sources lives."""
    return envs.PAGEDATTN_EXT_DIR / f"{isa}-{_cpu_tag()}-{build_key(isa)}"


def _import_library(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _build_lock(root: Path) -> Iterator[None]:
    """One build of a folder at a time, across processes (an flock the kernel releases when its
    holder dies)."""
    with open(root / ".build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(isa: str, work_dir: Path, verbose: bool) -> ModuleType:
    """Compile the sources for ``isa`` in ``work_dir`` and load the result (the caller holds the
    build lock)."""
    # NOTE: imported only to build: it pulls in setuptools (40-110 ms of a start).
    from torch.utils.cpp_extension import load

    # NOTE: torch's own build lock is a plain file: a build killed midway (a Ray replica shut
    # down while it compiled) leaves it behind, and every later build waits on it forever. Under
    # our flock nobody else is building here, so one left over is stale.
    (work_dir / "lock").unlink(missing_ok=True)
    return load(
        name=EXTENSION_NAME,
        sources=[str(s) for s in SOURCES],
        extra_cflags=build_flags(isa),
        extra_ldflags=["-fopenmp"],
        build_directory=str(work_dir),
        verbose=verbose,
    )


def load_extension(verbose: bool = False, isa: str | None = None) -> ModuleType:
    """Compile (or load the cached build of) the extension for ``isa`` (default: this process's
    level, ``features.isa_level()``); raise ExtensionBuildError on failure."""
    global _module, _module_isa, _error
    isa = features.isa_level() if isa is None else isa
    if _module is not None:
        if isa != _module_isa:
            raise ExtensionBuildError(
                f"this process loaded the {_module_isa} build; the {isa} build needs a process "
                f"of its own (PAGEDATTN_CPU_ISA={isa})"
            )
        return _module
    missing = [s for s in SOURCES if not s.is_file()]
    if missing:
        raise ExtensionBuildError(
            f"{missing[0]} is missing: the compiled CPU kernel needs a source checkout "
            "(pip install -e .)"
        )
    root = build_dir(isa)
    published = root / f"{EXTENSION_NAME}.so"
    work_dir = root / "build"
    try:
        if published.is_file():
            _module, _module_isa = _import_library(published), isa
            return _module
        work_dir.mkdir(parents=True, exist_ok=True)
        with _build_lock(root):
            if published.is_file():  # another process built it while this one waited
                _module, _module_isa = _import_library(published), isa
                return _module
            _module, _module_isa = _build(isa, work_dir, verbose), isa
            # NOTE: copy then rename, so that another process never imports a half-written file.
            tmp = root / f".{EXTENSION_NAME}.{os.getpid()}.so"
            shutil.copyfile(work_dir / f"{EXTENSION_NAME}.so", tmp)
            os.replace(tmp, published)
    except Exception as exc:  # NOTE: any compiler or loader failure means "no extension".
        _error = f"{type(exc).__name__}: {exc}"
        raise ExtensionBuildError(
            f"building {SOURCE.name} for {isa} in {work_dir} failed ({_error}); it needs a C++17 "
            "compiler (g++) and ninja"
        ) from exc
    return _module


def get_extension() -> ModuleType | None:
    """The loaded extension, or None when disabled or unbuildable (the reason is logged once)."""
    global _error
    if envs.PAGEDATTN_DISABLE_CPU_EXT:
        return None
    if _module is not None or _error is not None:
        return _module
    try:
        return load_extension()
    except ExtensionBuildError as exc:
        _error = str(exc)
        logger.warning("compiled CPU attention unavailable, using the PyTorch path: %s", exc)
        return None


def step_ops(enabled: bool = True) -> ModuleType | None:
    """The extension for the per-layer step ops (cache write, rotary, RMSNorm, SwiGLU, argmax),
    or None when it is unavailable or not ``enabled`` (KernelPlan.step_ops)."""
    return get_extension() if enabled else None


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether paged_decode handles these tensors (CPU, one fp32/bf16 dtype or an fp8 / u8
    cache, D % 16 == 0)."""
    return (
        query.device.type == "cpu"
        and key_cache.device.type == "cpu"
        and (query.dtype == key_cache.dtype or key_cache.dtype in QUANTIZED_CACHE_DTYPES)
        and query.dtype in SUPPORTED_DTYPES
        and query.shape[-1] % HEAD_SIZE_MULTIPLE == 0
    )


def gather_dequant_fp8(
    cache: torch.Tensor, block_ids: torch.Tensor, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """Blocks ``block_ids`` of an fp8 cache [num_blocks, ...] dequantized (x * scale) into
    ``out`` [len(block_ids), ...] (float32/bfloat16), as ``fp8.dequantize`` of the index_select.
    Raises ExtensionBuildError if the extension cannot be built."""
    load_extension().gather_dequant_fp8(out, cache, block_ids.to(torch.int64).contiguous(), scale)
    return out


def gather_dequant_u8(
    cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Blocks ``block_ids`` of a u8 cache [num_blocks, B, Hkv, D + 8] dequantized into ``out``
    [len(block_ids), B, Hkv, D] (float32/bfloat16), as ``u8.dequantize`` of the index_select.
    Raises ExtensionBuildError if the extension cannot be built."""
    load_extension().gather_dequant_u8(out, cache, block_ids.to(torch.int64).contiguous())
    return out


def _window_and_cap(sliding_window: int | None, logits_soft_cap: float | None) -> tuple[int, float]:
    """The attention kernels' window and soft cap (their sentinels for none); ValueError for a
    window or cap that is not positive."""
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    if logits_soft_cap is not None and logits_soft_cap <= 0:
        raise ValueError(f"logits_soft_cap must be positive or None, got {logits_soft_cap}")
    return sliding_window or NO_SLIDING_WINDOW, float(logits_soft_cap or NO_SOFT_CAP)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    out: torch.Tensor | None = None,
    amx: bool = False,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query per row over the flash-layout cache -> [N, Hq, D] in the query dtype.

    ``amx``: bf16 on the AMX tiles where the CPU, the build and the shapes allow it (blocks of 16
    tokens, D % 32 == 0, no sliding window); elsewhere the vector kernel runs.
    An fp8 cache (e4m3/e5m2) is read as stored * k_scale / * v_scale, on the vector kernel; a
    u8 cache [num_blocks, B, Hkv, D + 8] (attention.u8) with each row's scale and min.

    query [N, Hq, D]; key/value_cache [num_blocks, B, Hkv, D]; block_tables [N, max_blocks];
    seq_lens [N] (row n attends to positions < seq_lens[n], its query sits at seq_lens[n] - 1).
    Raises ExtensionBuildError if the extension cannot be built.
    """
    ext = load_extension()
    window, soft_cap = _window_and_cap(sliding_window, logits_soft_cap)
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    ext.paged_decode(
        out,
        query,
        key_cache,
        value_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        float(scale),
        window,
        soft_cap,
        partition_size,
        amx,
        float(k_scale),
        float(v_scale),
    )
    return out


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of the last ``len(query)`` positions of a sequence of ``seq_len`` tokens
    over its keys and values, read through ``block_table`` -> [q_len, Hq, D] (flash-style: no
    score matrix, no gathered copy). query [q_len, Hq, D] (float32 or bfloat16); the caches
    [num_blocks, B, Hkv, D] in its dtype, fp8 (read as stored * k_scale / * v_scale) or u8
    ([.., D + 8], attention.u8). Raises ExtensionBuildError if the extension cannot be built."""
    ext = load_extension()
    window, soft_cap = _window_and_cap(sliding_window, logits_soft_cap)
    query = query.contiguous()
    out = torch.empty_like(query)
    ext.paged_prefill(
        out,
        query,
        key_cache,
        value_cache,
        block_table.to(torch.int32).contiguous(),
        int(seq_len),
        float(scale),
        window,
        soft_cap,
        float(k_scale),
        float(v_scale),
    )
    return out


def amx_available() -> bool:
    """Whether the extension was built for AMX-BF16 and the OS granted this process the tiles."""
    ext = get_extension()
    return ext is not None and ext.linear_amx_available()


def quant_amx_available() -> bool:
    """Whether interleaved GGUF layers can run on AMX-INT8 tiles: the extension was built for
    them (-march=native on an AMX CPU) and the OS granted this process the tiles."""
    ext = get_extension()
    return ext is not None and ext.quant_amx_available()


def flush_denormals_all_threads() -> bool:
    """Flush denormals to zero in this thread and every intra-op worker (False if unavailable).

    NOTE: ``torch.set_flush_denormal`` only sets the calling thread's MXCSR; threads the OpenMP
    pool created earlier keep computing on denormals, 5-10x slower.
    """
    torch.set_flush_denormal(True)
    ext = get_extension()
    if ext is None:
        return False
    ext.set_flush_denormal_all_threads(True)
    return True


def keep_freed_heap_memory() -> bool:
    """Have glibc serve step-sized tensors from the heap and keep freed memory (False: not glibc).

    NOTE: by default glibc hands allocations above its (adaptive) mmap threshold to fresh mmaps
    and trims the heap top on free, so each step's multi-MB activations are page-faulted and
    zeroed again: ~28,000 minor faults per 2,048-token SmolLM2 prefill step, none with this. The
    cost is that the process keeps its peak heap (as jemalloc and tcmalloc do).
    """
    import ctypes

    # NOTE: the process's own symbols include libc's; ctypes.util.find_library("c") would run
    # ldconfig in a subprocess on every engine start.
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    mmap_ok = mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed on 64-bit
    trim_ok = mallopt(m_trim_threshold, (1 << 31) - 1)
    return bool(mmap_ok and trim_ok)
