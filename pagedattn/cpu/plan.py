"""KernelPlan: which CPU kernel runs each part of a step, chosen once from the model's shapes.

The runner chooses the plan before any module exists (``choose_plan``, from the checkpoint's
config and the dtype), then hands it down: the attention backend is built with its decode kernel,
the model's Linear layers pack their weights for its linear kernels, and the runner sets its
thread count. Nothing reads a choice back from a module.

A forced choice (``KernelOptions``: ``--linear-kernel``, ``--attention-kernel``) is checked
against what this CPU and build can run; "auto" takes the cached plan for this CPU signature,
dtype, shapes, torch version and candidate set, or measures one (``pagedattn.cpu.tuner``, a few
seconds) and caches it in ``<PAGEDATTN_CACHE_DIR>/kernel_plans.json``. ``PAGEDATTN_RETUNE=1``
measures again. The plan is printed once to stderr as a ``[kernels]`` line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from pagedattn import disk_cache, envs
from pagedattn.cpu import extension, features, tuner
from pagedattn.cpu.linear import (
    GGUF_PREFILL_ROWS,
    INT8_KERNELS,
    KERNELS,
    QUANTIZATIONS,
    candidates,
    kernel_available,
)
from pagedattn.cpu.linear import get_kernel as get_linear_kernel
from pagedattn.cpu.quant import QUANTIZE_TYPES

AUTO = "auto"
DEQUANTIZE = "dequantize"
WEIGHT_FORMATS = (AUTO, DEQUANTIZE)
GGUF_KERNEL = "gguf"
CACHE_FILE = "kernel_plans.json"
PLAN_VERSION = 6  # bump when what is measured or chosen changes, so old plans are measured again
# Decode attention kernels: the extension's vector kernel, its AMX tile path, PyTorch's SDPA.
ATTENTION_KERNELS = ("compiled", "amx", "torch")
# (candidate names, dtype) -> seconds of one timed decode attention call per candidate.
MeasureAttention = Callable[[Sequence[str], torch.dtype], dict[str, float]]
# KV cache dtypes (--kv-cache-dtype) whose decode rows the AMX tile path runs with bf16 queries:
# the model's own bf16 and fp8 (AMX-BF16), u8 (AMX-INT8).
AMX_KV_CACHE_DTYPES = (AUTO, "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "u8")


class ShapeConfig(Protocol):
    """The config fields the plan reads (pagedattn.model.text_config.TextConfig has them)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


class ModelShapes(NamedTuple):
    """What a plan is chosen from: every projection's (out, in), the LM head's, the heads."""

    layers: tuple[tuple[int, int], ...]
    head: tuple[int, int]
    num_heads: int
    num_kv_heads: int
    head_size: int


def model_shapes(config: ShapeConfig) -> ModelShapes:
    """The shapes of a Llama-family or Gemma 3 model (fused qkv and gate/up, per layer)."""
    hidden, heads, kv_heads = (
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
    )
    head_size = getattr(config, "head_dim", None) or hidden // heads
    q_size, kv_size, inter = heads * head_size, kv_heads * head_size, config.intermediate_size
    layer = ((q_size + 2 * kv_size, hidden), (hidden, q_size), (2 * inter, hidden), (hidden, inter))
    return ModelShapes(
        layer * config.num_hidden_layers,
        (config.vocab_size, hidden),
        heads,
        kv_heads,
        head_size,
    )


@dataclass(frozen=True)
class KernelOptions:
    """What the user asked for (ModelConfig's kernel fields); "auto" leaves it to the plan."""

    linear_kernel: str = AUTO
    attention_kernel: str = AUTO
    quantization: str | None = None
    decode_stack: bool = True
    step_ops: bool = True
    # The KV cache dtype (--kv-cache-dtype): the decode attention kernels are timed on it.
    kv_cache_dtype: str = AUTO
    # Speculative decoding: steps that verify drafts have at most verify_rows - 1 rows (0: none).
    verify_rows: int = 0
    # GGUF weights: auto runs quantised types as stored (the gguf kernel), dequantize widens them.
    weights: str = AUTO
    # False: every matrix of the model is in GGUF blocks the gguf kernel runs, so no float
    # linear kernel is measured (they would run nothing).
    float_weights: bool = True

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"weights={self.weights!r} is invalid: use one of {', '.join(WEIGHT_FORMATS)}"
            )
        if self.quantization in QUANTIZE_TYPES and self.weights == DEQUANTIZE:
            raise ValueError(
                f"quantization={self.quantization!r} quantises to GGUF blocks, which "
                "weights='dequantize' widens again: leave weights at auto"
            )
        allowed = (AUTO, *KERNELS, *INT8_KERNELS)
        if self.linear_kernel not in allowed:
            raise ValueError(
                f"linear_kernel={self.linear_kernel!r} is invalid: use one of {', '.join(allowed)}"
            )
        if self.attention_kernel not in (AUTO, *ATTENTION_KERNELS):
            raise ValueError(
                f"attention_kernel={self.attention_kernel!r} is invalid: use one of "
                f"{', '.join((AUTO, *ATTENTION_KERNELS))}"
            )
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"quantization={self.quantization!r} is invalid: use None or one of "
                f"{', '.join(QUANTIZATIONS)}"
            )
        if self.linear_kernel in INT8_KERNELS and self.quantization is None:
            raise ValueError(
                f"linear_kernel={self.linear_kernel!r} runs int8 weights: add quantization='int8'"
            )


@dataclass(frozen=True)
class KernelPlan:
    """The kernels of one model on one CPU: linear per regime, decode attention, threads."""

    linear_decode: str = "torch"  # rows below prefill_rows
    linear_prefill: str = "torch"
    linear_head: str = "torch"
    prefill_rows: int = tuner.DEFAULT_PREFILL_ROWS
    attention: str = "torch"  # decode attention: one of ATTENTION_KERNELS
    threads: int = 0  # torch threads to run on; 0: as configured
    decode_stack: bool = False  # the compiled decode stack (Llama-family models)
    step_ops: bool = False  # compiled norms, rotary, activations and cache writes
    isa: str = "scalar"  # the vector instructions the plan was chosen for (features.vector_isa)
    # Steps that verify draft tokens, 2 .. verify_rows - 1 rows, run this linear kernel in the
    # decode stack and the LM head; None: the decode and head kernels (see verify_fields).
    linear_verify: str | None = None
    verify_rows: int = 0
    # Weights stored in GGUF blocks (a GGUF file's Q2_K ... IQ4_XS tensors, --quantization q8_0 ...)
    # run as stored on this kernel ("gguf"); None: they are dequantised at load.
    linear_quant: str | None = None
    # --quantization's GGUF block type for an HF checkpoint's projections (None: as stored).
    quantize_to: str | None = None
    # GGUF layers run their int8 dot kernels below this many rows, dequantised tiles from it
    # (measured per CPU and model shape: tuner.tune_quant_rows).
    quant_prefill_rows: int = GGUF_PREFILL_ROWS
    # ... and their interleaved parts run on AMX-INT8 tiles from this many rows (0: never; only
    # where the tiles measured faster: tuner.tune_quant_amx_rows).
    quant_amx_rows: int = 0

    @classmethod
    def single(cls, kernel: str, **fields) -> KernelPlan:
        """One linear kernel for every regime."""
        return cls(kernel, kernel, kernel, **fields)

    def linear_for(self, rows: int) -> str:
        """The linear kernel of a call with ``rows`` rows."""
        return self.linear_prefill if rows >= self.prefill_rows else self.linear_decode

    def describe(self) -> str:
        if self.linear_decode == self.linear_prefill == self.linear_head:
            text = f"linear {self.linear_decode}"
        else:
            text = (
                f"linear decode {self.linear_decode}, prefill {self.linear_prefill} "
                f"(>= {self.prefill_rows} rows), LM head {self.linear_head}"
            )
        if self.linear_verify is not None:
            text += f", verify {self.linear_verify} (2..{self.verify_rows - 1} rows)"
        text += f", decode attention {self.attention}"
        if self.threads:
            text += f", {self.threads} thread{'s' if self.threads > 1 else ''}"
        if not self.decode_stack:
            text += ", no decode stack"
        if not self.step_ops:
            text += ", PyTorch step ops"
        if self.linear_quant is not None:
            to = f", HF weights quantised to {self.quantize_to}" if self.quantize_to else ""
            text += f", GGUF blocks as stored on {self.linear_quant}{to}"
        return f"{text} [{self.isa}]"


def attention_available(kernel: str, dtype: torch.dtype, kv_cache_dtype: str = AUTO) -> bool:
    """Whether the decode attention ``kernel`` runs ``dtype`` queries here (on a cache of
    ``kv_cache_dtype``; for amx, one the tiles take)."""
    if kernel == "torch":
        return True
    if extension.get_extension() is None or dtype not in extension.SUPPORTED_DTYPES:
        return False
    return kernel == "compiled" or (
        dtype == torch.bfloat16
        and kv_cache_dtype in AMX_KV_CACHE_DTYPES
        and extension.amx_available()
    )


class KernelChoiceError(ValueError):
    """A kernel that was asked for cannot run here (CPU, build or dtype)."""


def _check_forced(options: KernelOptions, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    isa = features.vector_isa()
    if options.linear_kernel != AUTO and not get_linear_kernel(options.linear_kernel).available(
        dtype
    ):
        raise KernelChoiceError(
            f"linear kernel {options.linear_kernel!r} cannot run {name} on this CPU ({isa}): "
            f"use auto or one of {', '.join(candidates(dtype)) or 'torch'}"
        )
    if options.attention_kernel != AUTO and not attention_available(
        options.attention_kernel, dtype
    ):
        usable = [k for k in ATTENTION_KERNELS if attention_available(k, dtype)]
        raise KernelChoiceError(
            f"attention kernel {options.attention_kernel!r} cannot run {name} on this CPU "
            f"({isa}): use auto or one of {', '.join(usable)}"
        )


# NOTE: speculation's verify steps (K + 1 rows per sequence, a few sequences) run the panel GEMM
# when the decode kernel is another: it streams each weight once for up to 12 rows, so 5 rows
# cost little more than 1. SmolLM2-135M float32 (30 layers + LM head, 2 threads, Xeon with AMX,
# loaded machine, best of 25 interleaved passes): MKL's packed sgemm 30.2 ms at 1 row, 39.9 ms
# at 5 (1.32x); panels 30.9 / 35.4 ms (1.15x); F.linear 29.5 / 55.7 ms. The decode kernel stays
# what the tuner chose at 32 rows (MKL there: ~8% ahead of panels) for plain decode steps.
VERIFY_KERNEL = "panels"
# Decode kernels that already stream each weight once for a few rows (no verify kernel beside).
PANEL_KERNELS = (VERIFY_KERNEL, "dpbf16")


def verify_fields(options: KernelOptions, dtype: torch.dtype, plan: KernelPlan) -> dict:
    """The plan's linear_verify and verify_rows for ``options`` (replace() keywords): the panel
    kernel for verify steps where speculation asks for it, the decode stack may run them, auto
    chose a decode kernel that is not a panel GEMM and panels run ``dtype`` here."""
    use = (
        options.verify_rows > 2
        and options.decode_stack
        and options.linear_kernel == AUTO
        and options.quantization is None
        and plan.linear_decode not in PANEL_KERNELS
        and get_linear_kernel(VERIFY_KERNEL).available(dtype)
    )
    if not use:
        return dict(linear_verify=None, verify_rows=0)
    return dict(linear_verify=VERIFY_KERNEL, verify_rows=options.verify_rows)


def choose_plan(
    shapes: ModelShapes,
    dtype: torch.dtype,
    options: KernelOptions = KernelOptions(),
    measure_attention: MeasureAttention | None = None,
    device: str | torch.device = "cpu",
    measure_linear: tuner.Measure | None = None,
) -> KernelPlan:
    """The plan for a model of ``shapes`` in ``dtype`` on this CPU (see the module docstring).

    ``measure_attention`` times the decode attention candidates (none: the first available is
    taken); ``measure_linear`` replaces the real timing of linear kernels (for tests). Raises
    KernelChoiceError when a forced kernel cannot run here.
    """
    if torch.device(device).type != "cpu":
        return KernelPlan(isa=torch.device(device).type)
    _check_forced(options, dtype)
    compiled = extension.get_extension() is not None
    quant = options.weights == AUTO and kernel_available(GGUF_KERNEL, dtype)
    if options.quantization in QUANTIZE_TYPES and not quant:
        raise KernelChoiceError(
            f"quantization={options.quantization!r} needs the compiled GGUF kernels, which do "
            f"not run {_dtype_name(dtype)} here (extension missing or disabled)"
        )
    fixed = dict(
        decode_stack=options.decode_stack and compiled,
        step_ops=options.step_ops and compiled,
        isa=features.vector_isa(),
        linear_quant=GGUF_KERNEL if quant else None,
        quantize_to=options.quantization if options.quantization in QUANTIZE_TYPES else None,
    )
    pool = INT8_KERNELS if options.quantization == "int8" else KERNELS
    linear = candidates(dtype, pool) or ["torch"]
    if options.linear_kernel != AUTO:
        linear = [options.linear_kernel]
    elif quant and not options.float_weights:
        linear = ["torch"]
    kv = options.kv_cache_dtype
    attention = [k for k in ATTENTION_KERNELS if attention_available(k, dtype, kv)]
    if options.attention_kernel != AUTO:
        attention = [options.attention_kernel]
    if len(linear) == 1 and (len(attention) == 1 or measure_attention is None):
        plan = KernelPlan.single(linear[0], attention=attention[0], **fixed)
        plan = dataclasses.replace(plan, **verify_fields(options, dtype, plan))
        why = "as asked" if options.float_weights else "every matrix in GGUF blocks"
        _announce(str(plan), f"{_dtype_name(dtype)}: {plan.describe()} ({why})")
        return plan
    key = _plan_key(shapes, dtype, linear, attention, kv)
    path = disk_cache.cache_root() / CACHE_FILE
    entry = {} if envs.PAGEDATTN_RETUNE else disk_cache.read_json(path).get(key)
    cached = _cached_plan(entry, linear, attention)
    if cached is not None and not (entry.get("busy") and not tuner.machine_busy()):
        plan = dataclasses.replace(cached, **fixed)
        plan = dataclasses.replace(plan, **verify_fields(options, dtype, plan))
        _announce(
            f"{key}|verify {plan.verify_rows}",
            f"{_dtype_name(dtype)}: {plan.describe()} (measured earlier; "
            "PAGEDATTN_RETUNE=1 measures again)",
        )
        return plan
    plan, times, seconds, busy = _measure(
        shapes, dtype, linear, attention, measure_attention, measure_linear
    )
    plan = dataclasses.replace(plan, **fixed)
    disk_cache.update_json(
        path,
        key,
        _measured_entry(times, plan=dataclasses.asdict(plan), busy=busy),
    )
    line = f"{_dtype_name(dtype)}: {plan.describe()} (measured in {seconds:.1f} s"
    if busy:
        line += " on 1 thread, the machine being busy (measured again once it is quiet),"
    _announced.add(key)  # NOTE: a fresh measurement is always printed, then not again
    print(f"[kernels] {line} on {features.describe_cpu()}; cached in {path})", file=sys.stderr)
    return dataclasses.replace(plan, **verify_fields(options, dtype, plan))


# 2: the switch timed on blocks as stored (v1 timed Q4_K interleaved twice); 3: the AMX switch.
QUANT_PLAN_VERSION = 3


def with_quant_rows(plan: KernelPlan, shapes: ModelShapes) -> KernelPlan:
    """``plan`` with its GGUF layers' switches for ``shapes`` on this CPU (from dot kernels to
    tiles; from the interleaved AVX kernels to AMX-INT8 tiles): cached, or measured
    (tuner.tune_quant_rows and tune_quant_amx_rows, about a second each) and cached. Asked
    only for a model that holds GGUF blocks."""
    digest = hashlib.sha256(json.dumps(shapes.layers).encode()).hexdigest()[:16]
    key = (
        f"quant v{QUANT_PLAN_VERSION}|{features.cpu_signature()}|{digest}|torch "
        f"{torch.__version__}|ext {extension.build_key(features.isa_level())}"
    )
    path = disk_cache.cache_root() / CACHE_FILE
    entry = {} if envs.PAGEDATTN_RETUNE else disk_cache.read_json(path).get(key, {})
    entry = entry if isinstance(entry, dict) else {}
    rows, amx_rows = entry.get("quant_prefill_rows"), entry.get("quant_amx_rows")
    if isinstance(rows, int) and rows > 0 and isinstance(amx_rows, int):
        _announce(key, f"{_quant_switches(rows, amx_rows)} (measured earlier)")
        return dataclasses.replace(plan, quant_prefill_rows=rows, quant_amx_rows=amx_rows)
    start = time.perf_counter()
    rows, times = tuner.tune_quant_rows(shapes.layers)
    amx_rows, amx_times = tuner.tune_quant_amx_rows(shapes.layers)
    disk_cache.update_json(
        path,
        key,
        _measured_entry(times | amx_times, quant_prefill_rows=rows, quant_amx_rows=amx_rows),
    )
    _announced.add(key)
    print(
        f"[kernels] {_quant_switches(rows, amx_rows)} (measured in "
        f"{time.perf_counter() - start:.1f} s; cached in {path})",
        file=sys.stderr,
    )
    return dataclasses.replace(plan, quant_prefill_rows=rows, quant_amx_rows=amx_rows)


def _quant_switches(rows: int, amx_rows: int) -> str:
    amx = f"; Q4_K, Q6_K and Q8_0 on AMX-INT8 tiles from {amx_rows} rows" if amx_rows else ""
    return (
        f"GGUF layers: interleaved 8 rows, one kernel at every row count{amx}; parts of other "
        f"row counts: int8 dot kernels below {rows} rows, dequantised tiles from there"
    )


def _measured_entry(times: dict[str, dict[str, float]], **fields: object) -> dict:
    """A cache entry: ``fields``, the seconds measured (as ms), the CPU and when."""
    return {
        **fields,
        "times_ms": {r: {k: round(t * 1e3, 3) for k, t in ts.items()} for r, ts in times.items()},
        "cpu": features.describe_cpu(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _measure(
    shapes: ModelShapes,
    dtype: torch.dtype,
    linear: list[str],
    attention: list[str],
    measure_attention: MeasureAttention | None,
    measure_linear: tuner.Measure | None,
) -> tuple[KernelPlan, dict[str, dict[str, float]], float, bool]:
    start = time.perf_counter()
    busy = tuner.machine_busy()
    threads = torch.get_num_threads()

    def measure(kernels, weight_shapes, rows):
        return tuner.measure_kernels(kernels, weight_shapes, rows, dtype)

    measure = measure_linear or measure

    if busy:
        # NOTE: with more runnable processes than cores, a multi-threaded pass mostly measures
        # how long its threads wait for each other; one thread still ranks the kernels.
        torch.set_num_threads(1)
    try:
        times: dict[str, dict[str, float]] = {}
        choice = tuner.LinearChoice(linear[0], linear[0], linear[0])
        if len(linear) > 1:
            choice, times = tuner.tune_linear(shapes.layers, shapes.head, dtype, linear, measure)
        chosen_attention = attention[0]
        if len(attention) > 1 and measure_attention is not None:
            times["attention"] = measure_attention(attention, dtype)
            chosen_attention = tuner.fastest(times["attention"])
        num_threads = 0
        if not busy and threads > 1 and len(linear) > 1:
            num_threads = tuner.tune_threads(choice, shapes.layers, dtype, measure, times, threads)
    finally:
        torch.set_num_threads(threads)
    plan = KernelPlan(*choice, attention=chosen_attention, threads=num_threads)
    return plan, times, time.perf_counter() - start, busy


def _plan_key(
    shapes: ModelShapes,
    dtype: torch.dtype,
    linear: list[str],
    attention: list[str],
    kv_cache_dtype: str = AUTO,
) -> str:
    """Cache key: CPU signature, dtype, shapes, torch version, the extension's build (its
    sources and flags: a kernel changed is a kernel to measure again), the candidates and the KV
    cache dtype (unless auto)."""
    digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
    kv = "" if kv_cache_dtype == AUTO else f"|kv {kv_cache_dtype}"
    return (
        f"v{PLAN_VERSION}|{features.cpu_signature()}|{_dtype_name(dtype)}|{digest}|"
        f"torch {torch.__version__}|ext {extension.build_key(features.isa_level())}|"
        f"{','.join(linear)}|{','.join(attention)}{kv}"
    )


def _cached_plan(entry: object, linear: list[str], attention: list[str]) -> KernelPlan | None:
    try:
        plan = KernelPlan(**entry["plan"])  # type: ignore[index]
    except (TypeError, KeyError):
        return None
    chosen = (plan.linear_decode, plan.linear_prefill, plan.linear_head)
    ok = all(k in linear for k in chosen) and plan.attention in attention
    return plan if ok and plan.prefill_rows > 0 else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_announced: set[str] = set()


def _announce(key: str, line: str) -> None:
    """Print the kernel choice to stderr, once per process and key."""
    if key not in _announced:
        _announced.add(key)
        print(f"[kernels] {line}", file=sys.stderr, flush=True)
