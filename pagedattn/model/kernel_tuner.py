"""Pick the CPU linear kernels by timing them on the model's own shapes, once per machine.

On the first load of a model on a CPU kind (``cpu_features.cpu_signature()``) in a dtype, every
kernel that can run there (``packed_linear.KERNELS``) is timed on the model's projection shapes:

- decode: ``DECODE_ROWS`` rows through enough of the model's layers to stream ~48 MiB of weights
  per pass (as a decode step streams the whole model from memory);
- prefill: ``PREFILL_ROWS`` rows (the engine's default prefill chunk) through the same weights
  as decode: with the weights streaming from memory, as in a model's prefill step, oneDNN packed
  at load beat plain ``F.linear`` by 3-25% here at 2,048 rows, while with one layer's weights
  hot in cache (the earlier measure, at 512 rows) ``F.linear`` won;
- LM head: ``DECODE_ROWS`` rows through (up to 16k rows of) the head;

and where the decode and prefill winners differ, the row count at which the prefill kernel
starts winning. Then the decode attention kernels (the extension's paged decode and the PyTorch
gather + SDPA path) on ``DECODE_ROWS`` sequences of ``ATTENTION_CONTEXT`` tokens with the model's
heads (and, for bf16 on a CPU with AMX, that kernel's tile path), and the thread count: the
decode and prefill passes again on one thread, which the plan keeps only when it wins both by
10% (two vCPUs that share one core can run faster on one).
Candidates run interleaved, round after round, and each keeps its fastest pass,
so a busy machine slows all of them alike; when the load average says other processes hold every
core, the kernels are timed on one thread (multi-threaded passes then mostly time waits) and
the plan is kept only until a start on a quiet machine measures again. The plan is cached in
``~/.cache/pagedattn/kernel_plans.json`` under the CPU signature, dtype, shapes, torch version and
candidate set, and printed to stderr at start-up. ``PAGEDATTN_LINEAR=<kernel>`` forces one
kernel; ``PAGEDATTN_RETUNE=1`` measures again. Tuning takes a few seconds (SmolLM2 in bf16: ~5 s).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from pagedattn import disk_cache
from pagedattn.cpu.features import cpu_signature, describe_cpu
from pagedattn.model.packed_linear import (
    DEFAULT_PREFILL_ROWS,
    KERNEL_ENV,
    KERNELS,
    LinearPlan,
    PackedLinear,
    fitted_kernel,
    forced_kernel,
    kernel_available,
)

RETUNE_ENV = "PAGEDATTN_RETUNE"
CACHE_FILE = "kernel_plans.json"
PLAN_VERSION = 3  # bump when what is measured changes, so old plans are measured again
DECODE_ROWS = 32
PREFILL_ROWS = 2048
SPLIT_ROWS = (64, 128, 256, 512, 1024)  # row counts tried for the decode -> prefill switch
DECODE_PASS_BYTES = 24 << 20  # weights streamed per timed decode pass (well past L2)
HEAD_MAX_OUT = 16384  # LM head rows timed (the ranking does not change past this)
MIN_ROUNDS, MAX_ROUNDS = 3, 9
ROUND_BUDGET_S = 1.0  # per measurement; the rounds stop after MIN_ROUNDS once it is spent
HOPELESS = 3.0  # a kernel this many times slower than the best after a round is dropped
# One thread is kept only where it beats all threads by this factor in both regimes: on a busy
# moment one run of a tune measured 1 thread 2% faster at decode and 19% at prefill, and that
# plan then ran decode steps ~1.5x slower; wrongly keeping 2 threads costs a few percent at most.
ONE_THREAD_MARGIN = 0.9
ATTENTION_CONTEXT = 256  # tokens per sequence in the timed decode attention
ATTENTION_BLOCK_SIZE = 16

Shape = tuple[int, int]  # (out_features, in_features) of one weight
# (kernels, the weights of one pass, rows) -> seconds of the fastest pass, per kernel.
Measure = Callable[[Sequence[str], Sequence[Shape], int], dict[str, float]]


class AttentionShape(NamedTuple):
    """The heads of a model's attention layers."""

    num_heads: int
    num_kv_heads: int
    head_size: int


class TuneResult(NamedTuple):
    """The plan chosen and what was measured for it (seconds per pass, by regime and kernel)."""

    plan: LinearPlan
    times: dict[str, dict[str, float]]
    seconds: float
    busy: bool = False  # measured on one thread while other processes held the cores


def machine_busy() -> bool:
    """True when the 1-minute load average says other processes compete for every core."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load >= (os.cpu_count() or 1) + 0.5


def candidates(dtype: torch.dtype, kernels: Sequence[str] = KERNELS) -> list[str]:
    """The ``kernels`` that can run a linear layer in ``dtype`` here, in their order."""
    return [k for k in kernels if kernel_available(k, dtype)]


def fastest(times: dict[str, float]) -> str:
    """The kernel with the smallest time (the first listed on a tie)."""
    return min(times, key=lambda k: times[k])


def measure_kernels(
    kernels: Sequence[str], shapes: Sequence[Shape], rows: int, dtype: torch.dtype
) -> dict[str, float]:
    """Seconds of the fastest pass of each kernel over random weights of ``shapes``."""
    gen = torch.Generator().manual_seed(0)
    # NOTE: one random tensor per distinct shape, copied: distinct memory streams like a model's
    # weights, and copying is far cheaper than drawing random numbers.
    first = {s: torch.randn(s, generator=gen).mul_(0.02).to(dtype) for s in dict.fromkeys(shapes)}
    weights = [first[s].clone() for s in shapes]
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in shapes}
    passes = {}
    for kernel in kernels:
        # NOTE: a weight the kernel cannot take runs what the model would run in its place.
        layers = [PackedLinear(fitted_kernel(w, kernel), w, None) for w in weights]

        def one_pass(layers=layers) -> None:
            for layer in layers:
                layer(inputs[layer.in_features])

        passes[kernel] = one_pass
    return fastest_passes(passes)


def fastest_passes(passes: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Seconds of the fastest call of each function, called in turn round after round (a
    function ``HOPELESS`` times slower than the best after two rounds stops being called)."""
    best = dict.fromkeys(passes, math.inf)
    live = list(passes)
    with torch.inference_mode():
        for one_pass in passes.values():
            one_pass()  # NOTE: warm-up; oneDNN builds its primitive on the first call
        start = time.perf_counter()
        for r in range(MAX_ROUNDS):
            for name in live[r % len(live) :] + live[: r % len(live)]:
                t0 = time.perf_counter()
                passes[name]()
                best[name] = min(best[name], time.perf_counter() - t0)
            if r >= 1:
                floor = min(best.values())
                live = [k for k in live if best[k] <= HOPELESS * floor]
            if r + 1 >= MIN_ROUNDS and time.perf_counter() - start > ROUND_BUDGET_S:
                break
    return best


def measure_attention(shape: AttentionShape, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of one decode attention call per candidate: ``DECODE_ROWS`` sequences of
    ``ATTENTION_CONTEXT`` tokens in shuffled blocks of a flash-layout cache."""
    from pagedattn.attention.backends.cpu import CpuBackend
    from pagedattn.attention.metadata import AttentionMetadata

    block = ATTENTION_BLOCK_SIZE
    per_seq = ATTENTION_CONTEXT // block
    gen = torch.Generator().manual_seed(0)
    cache_shape = (DECODE_ROWS * per_seq, block, shape.num_kv_heads, shape.head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    tables = torch.randperm(cache_shape[0], generator=gen).view(DECODE_ROWS, per_seq).tolist()
    metadata = AttentionMetadata.build(
        [1] * DECODE_ROWS, [ATTENTION_CONTEXT] * DECODE_ROWS, tables, block
    )
    query = torch.randn(DECODE_ROWS, shape.num_heads, shape.head_size, generator=gen).to(dtype)
    scale = shape.head_size**-0.5
    backends = {"compiled": CpuBackend(), "torch": CpuBackend(use_extension=False)}
    if not backends["compiled"].uses_extension:
        del backends["compiled"]
    elif kernel_available("amx", dtype):
        backends["amx"] = CpuBackend()
        backends["amx"].use_compiled_decode(True, amx=True)
    return fastest_passes(
        {
            name: lambda b=backend: b.forward(query, key_cache, value_cache, metadata, scale=scale)
            for name, backend in backends.items()
        }
    )


def decode_shapes(layer_shapes: Sequence[Shape], dtype: torch.dtype) -> list[Shape]:
    """The model's first weights, in order, up to DECODE_PASS_BYTES (at least one of each shape)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    chosen, total, seen = [], 0, set()
    for shape in layer_shapes:
        if total >= DECODE_PASS_BYTES and shape in seen:
            continue
        chosen.append(shape)
        seen.add(shape)
        total += shape[0] * shape[1] * itemsize
    return chosen


def tune(
    layer_shapes: Sequence[Shape],
    head_shape: Shape,
    dtype: torch.dtype,
    measure: Measure | None = None,
    attention: AttentionShape | None = None,
    kernels: Sequence[str] = KERNELS,
) -> TuneResult:
    """Time every candidate of ``kernels`` on these shapes and pick the fastest per regime; with
    ``attention``, the decode attention kernels too. On a quiet machine with several threads,
    the linear passes again on one thread."""
    if measure is None:

        def measure(kernels, shapes, rows):
            return measure_kernels(kernels, shapes, rows, dtype)

    start = time.perf_counter()
    kernels = candidates(dtype, kernels)
    busy = machine_busy()
    threads = torch.get_num_threads()
    if busy:
        # NOTE: with more runnable processes than cores, a multi-threaded pass mostly measures
        # how long its threads wait for each other; one thread still ranks the kernels.
        torch.set_num_threads(1)
    try:
        plan, times = _tune(layer_shapes, head_shape, dtype, kernels, measure)
        if attention is not None:
            times["attention"] = measure_attention(attention, dtype)
            plan = plan._replace(attention=fastest(times["attention"]))
        if not busy and threads > 1:
            plan = _tune_threads(plan, layer_shapes, dtype, measure, times, threads)
    finally:
        torch.set_num_threads(threads)
    return TuneResult(plan, times, time.perf_counter() - start, busy)


def _tune_threads(
    plan: LinearPlan,
    layer_shapes: Sequence[Shape],
    dtype: torch.dtype,
    measure: Measure,
    times: dict[str, dict[str, float]],
    threads: int,
) -> LinearPlan:
    """``plan`` with threads=1 when one thread runs both its decode and prefill passes clearly
    faster (``ONE_THREAD_MARGIN``) than ``threads`` threads, else with threads=``threads``."""
    streamed = decode_shapes(layer_shapes, dtype)
    regimes = {
        "decode": (plan.decode, streamed, DECODE_ROWS),
        "prefill": (plan.prefill, streamed, PREFILL_ROWS),
    }
    wins = []
    for regime, (kernel, shapes, rows) in regimes.items():
        torch.set_num_threads(1)
        try:
            single = measure([kernel], shapes, rows)[kernel]
        finally:
            torch.set_num_threads(threads)
        times[f"threads_{regime}"] = {f"{threads}": times[regime][kernel], "1": single}
        wins.append(single < ONE_THREAD_MARGIN * times[regime][kernel])
    return plan._replace(threads=1 if all(wins) else threads)


def _tune(
    layer_shapes: Sequence[Shape],
    head_shape: Shape,
    dtype: torch.dtype,
    kernels: list[str],
    measure: Measure,
) -> tuple[LinearPlan, dict[str, dict[str, float]]]:
    streamed = decode_shapes(layer_shapes, dtype)
    times = {
        "decode": measure(kernels, streamed, DECODE_ROWS),
        "prefill": measure(kernels, streamed, PREFILL_ROWS),
        "head": measure(kernels, [(min(head_shape[0], HEAD_MAX_OUT), head_shape[1])], DECODE_ROWS),
    }
    decode, prefill = fastest(times["decode"]), fastest(times["prefill"])
    split = DEFAULT_PREFILL_ROWS
    if decode != prefill:
        split = PREFILL_ROWS
        for rows in SPLIT_ROWS:
            times[f"rows_{rows}"] = t = measure([decode, prefill], streamed, rows)
            if t[prefill] <= t[decode]:
                split = rows
                break
    return LinearPlan(decode, prefill, fastest(times["head"]), split), times


def plan_key(
    layer_shapes: Sequence[Shape],
    head_shape: Shape,
    dtype: torch.dtype,
    kernels: Sequence[str] = KERNELS,
) -> str:
    """Cache key: CPU signature, dtype, shapes, torch version and the candidate kernels."""
    shapes = json.dumps([list(s) for s in (*layer_shapes, head_shape)])
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    kernels = ",".join(candidates(dtype, kernels))
    return (
        f"v{PLAN_VERSION}|{cpu_signature()}|{str(dtype).removeprefix('torch.')}|{digest}|"
        f"torch {torch.__version__}|{kernels}"
    )


def cache_path() -> Path:
    return disk_cache.cache_root() / CACHE_FILE


def _cached(entry: object, dtype: torch.dtype) -> LinearPlan | None:
    try:
        plan = LinearPlan(**entry["plan"])  # type: ignore[index]
    except (TypeError, KeyError):
        return None
    ok = all(kernel_available(k, dtype) for k in plan[:3]) and plan.prefill_rows > 0
    if plan.attention == "amx":
        ok = ok and kernel_available("amx", dtype)
    return plan if ok else None


_announced: set[str] = set()


def announce(key: str, line: str) -> None:
    """Print the kernel choice to stderr, once per process and key."""
    if key not in _announced:
        _announced.add(key)
        print(f"[kernels] {line}", file=sys.stderr, flush=True)


def plan_for_shapes(
    layer_shapes: Sequence[Shape],
    head_shape: Shape,
    dtype: torch.dtype,
    measure: Measure | None = None,
    attention: AttentionShape | None = None,
    kernels: Sequence[str] = KERNELS,
) -> LinearPlan:
    """The forced, cached or freshly measured plan for a model with these shapes in ``dtype``
    (``kernels``: the candidates, e.g. INT8_KERNELS for int8 weights, which nothing forces)."""
    name = str(dtype).removeprefix("torch.")
    forced = forced_kernel() if tuple(kernels) == KERNELS else None
    if forced is not None:
        announce(f"forced {forced}", f"{name}: linear {forced} (forced by {KERNEL_ENV})")
        return LinearPlan.single(forced)
    key = plan_key(layer_shapes, head_shape, dtype, kernels)
    path = cache_path()
    if os.environ.get(RETUNE_ENV, "") in ("", "0"):
        entry = disk_cache.read_json(path).get(key)
        plan = _cached(entry, dtype)
        if plan is not None and entry.get("busy") and not machine_busy():
            plan = None  # NOTE: measured on a busy machine; measure again now that it is quiet
        if plan is not None:
            announce(key, f"{name}: {plan.describe()} (measured earlier; {RETUNE_ENV}=1 retunes)")
            return plan
    result = tune(layer_shapes, head_shape, dtype, measure, attention, kernels)
    entry = {
        "plan": result.plan._asdict(),
        "times_ms": {
            r: {k: round(t * 1e3, 3) for k, t in ts.items()} for r, ts in result.times.items()
        },
        "cpu": describe_cpu(),
        "busy": result.busy,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    disk_cache.update_json(path, key, entry)
    _announced.discard(key)
    line = f"{name}: {result.plan.describe()} (measured in {result.seconds:.1f} s"
    if result.busy:
        line += " on 1 thread, the machine being busy (measured again once it is quiet),"
    announce(key, f"{line} on {describe_cpu()}; cached in {path})")
    return result.plan


def model_shapes(model: nn.Module, head: nn.Module | None = None) -> list[Shape]:
    """(out, in) of every nn.Linear of ``model`` but ``head``, in module order."""
    return [
        (m.out_features, m.in_features)
        for m in model.modules()
        if isinstance(m, nn.Linear) and m is not head
    ]


def plan_for_model(model: nn.Module, kernels: Sequence[str] = KERNELS) -> LinearPlan:
    """The plan for a PagedCausalLM (its projections, its LM head and its dtype), among
    ``kernels``; one candidate alone is used without measuring."""
    usable = candidates(model.dtype, kernels)
    if len(usable) == 1:
        return LinearPlan.single(usable[0])
    head = None if model.tie_word_embeddings else model.lm_head
    head_shape = tuple(model.lm_head_weight().shape)
    attention = model_attention_shape(model)
    return plan_for_shapes(
        model_shapes(model, head), head_shape, model.dtype, None, attention, kernels
    )


def model_attention_shape(model: nn.Module) -> AttentionShape | None:
    """The heads of the model's first PagedAttention layer (None if it has none)."""
    from pagedattn.model.layers import PagedAttention

    for module in model.modules():
        if isinstance(module, PagedAttention):
            return AttentionShape(module.num_heads, module.num_kv_heads, module.head_size)
    return None
