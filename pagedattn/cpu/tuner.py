"""Measure CPU kernels on a model's own shapes: linear kernels per regime, threads, attention.

Measuring only: ``pagedattn.cpu.plan`` decides when to measure, caches what was chosen and turns
the times into a KernelPlan. Every linear candidate (``linear.candidates``) is timed on random
weights of the model's projection shapes:

- decode: ``DECODE_ROWS`` rows through enough of the model's layers to stream at least 24 MiB
  and twice the last-level cache per pass, up to the whole model (as a decode step streams the
  whole model, from memory or a large L3);
- prefill: ``PREFILL_ROWS`` rows through the model's first ~24 MiB of weights;
- LM head: ``DECODE_ROWS`` rows through (up to 16k rows of) the head;

and where the decode and prefill winners differ, the row count at which the prefill kernel starts
winning. Prefill prefers a kernel that runs on the decode kernel's own weights when it is nearly
as fast (``prefill_kernel``), so a layer keeps one packed form of them where a second buys little.
The decode attention candidates are timed by a function the caller hands in (the attention
backends live above this package). Candidates run interleaved, round after round, and
each keeps its fastest pass, so a busy machine slows all of them alike; when the load average
says other processes hold every core, everything is timed on one thread.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from pagedattn.cpu import extension, features
from pagedattn.cpu.linear import QuantizedParts, pack_quantized, pack_weight, shares_weights
from pagedattn.cpu.quant import quantize

DECODE_ROWS = 32
PREFILL_ROWS = 2048
SPLIT_ROWS = (64, 128, 256, 512, 1024)  # row counts tried for the decode -> prefill switch
# Weights streamed per timed decode pass, at least: well past L2, and past twice the last-level
# cache (up to the model's own size), so that the decode kernels are timed streaming weights
# from where a step finds them. NOTE: on a Xeon with a 480 MiB L3, 24 MiB passes ran from L3,
# where MKL led at 32 rows (AVX2 cap, float32), while the model's 513 MiB streamed faster
# through the panels (53.3 ms against 58.4).
DECODE_PASS_BYTES = 24 << 20
HEAD_MAX_OUT = 16384  # LM head rows timed (the ranking does not change past this)
MIN_ROUNDS, MAX_ROUNDS = 3, 9
ROUND_BUDGET_S = 1.0  # per measurement; the rounds stop after MIN_ROUNDS once it is spent
HOPELESS = 3.0  # a kernel this many times slower than the best after a round is dropped
# One thread is kept only where it beats all threads by this factor in both regimes: on a busy
# moment one run of a tune measured 1 thread 2% faster at decode and 19% at prefill, and that
# plan then ran decode steps ~1.5x slower; wrongly keeping 2 threads costs a few percent at most.
ONE_THREAD_MARGIN = 0.9
# Rows at and above which a layer runs its prefill kernel when nothing was measured.
DEFAULT_PREFILL_ROWS = 128
# GGUF layers: row counts tried for the switch from the int8 dot kernels to dequantised tiles
# into at::mm (tune_quant_rows), and the weight rows of the layer they are timed on. NOTE: AMD
# EPYC Zen 2 (AVX2), 2 threads, an [8192, 2048] Q4_K layer: dot 11.1 ms at 32 rows against 21.9
# for the tiles, even at 128 rows (46.0 / 45.9 ms); a fixed switch at 16 rows made the 1B Q4_K_M
# model's 32-sequence decode steps 2.0 s against llama.cpp's 0.74.
QUANT_SPLIT_ROWS = (16, 32, 64, 128, 256, 512)
QUANT_TUNE_MAX_OUT = 4096
# Prefill takes a kernel that runs on the decode kernel's own copy of the weights (the same
# kernel, or F.linear on the plain weight MKL keeps) when it is within this share of the fastest:
# any other kernel packs a second copy of every weight. NOTE: AVX2 cap on the AMX Xeon,
# SmolLM2-135M float32, 2,048 rows: oneDNN 118.3 ms, F.linear 118.5, and oneDNN's copy cost
# 513 MiB beside MKL's two.
SHARED_WEIGHTS_MARGIN = 0.05

Shape = tuple[int, int]  # (out_features, in_features) of one weight
# (kernels, the weights of one pass, rows) -> seconds of the fastest pass, per kernel.
Measure = Callable[[Sequence[str], Sequence[Shape], int], dict[str, float]]


class LinearChoice(NamedTuple):
    """The linear kernels measured fastest: decode, prefill (from ``prefill_rows``), LM head."""

    decode: str
    prefill: str
    head: str
    prefill_rows: int = DEFAULT_PREFILL_ROWS


def machine_busy() -> bool:
    """True when the 1-minute load average says other processes compete for every core."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load >= (os.cpu_count() or 1) + 0.5


def fastest(times: dict[str, float]) -> str:
    """The candidate with the smallest time (the first listed on a tie)."""
    return min(times, key=lambda k: times[k])


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
        layers = [pack_weight(kernel, w) for w in weights]

        def one_pass(layers=layers) -> None:
            for layer in layers:
                layer(inputs[layer.in_features])

        passes[kernel] = one_pass
    return fastest_passes(passes)


def decode_pass_bytes() -> int:
    """Bytes of weights a timed decode pass streams: DECODE_PASS_BYTES or twice the last-level
    cache, whichever is more."""
    return max(DECODE_PASS_BYTES, 2 * features.last_level_cache_bytes())


def decode_shapes(
    layer_shapes: Sequence[Shape], dtype: torch.dtype, pass_bytes: int = DECODE_PASS_BYTES
) -> list[Shape]:
    """The model's first weights, in order, up to ``pass_bytes`` (at least one of each shape)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    chosen, total, seen = [], 0, set()
    for shape in layer_shapes:
        if total >= pass_bytes and shape in seen:
            continue
        chosen.append(shape)
        seen.add(shape)
        total += shape[0] * shape[1] * itemsize
    return chosen


def tune_linear(
    layer_shapes: Sequence[Shape],
    head_shape: Shape,
    dtype: torch.dtype,
    kernels: Sequence[str],
    measure: Measure,
) -> tuple[LinearChoice, dict[str, dict[str, float]]]:
    """The fastest of ``kernels`` per regime, and the seconds measured per regime and kernel."""
    # NOTE: prefill and the split are compute-bound: their passes keep to DECODE_PASS_BYTES
    # (a 2,048-row pass over a whole model would take seconds per kernel).
    streamed = decode_shapes(layer_shapes, dtype)
    times = {
        "decode": measure(
            kernels, decode_shapes(layer_shapes, dtype, decode_pass_bytes()), DECODE_ROWS
        ),
        "prefill": measure(kernels, streamed, PREFILL_ROWS),
        "head": measure(kernels, [(min(head_shape[0], HEAD_MAX_OUT), head_shape[1])], DECODE_ROWS),
    }
    decode = fastest(times["decode"])
    prefill = prefill_kernel(decode, times["prefill"])
    split = DEFAULT_PREFILL_ROWS
    if decode != prefill:
        split = PREFILL_ROWS
        for rows in SPLIT_ROWS:
            times[f"rows_{rows}"] = t = measure([decode, prefill], streamed, rows)
            if t[prefill] <= t[decode]:
                split = rows
                break
    return LinearChoice(decode, prefill, fastest(times["head"]), split), times


def prefill_kernel(decode: str, times: dict[str, float]) -> str:
    """The prefill kernel from its ``times``: the fastest that shares the ``decode`` kernel's
    weights where it is within SHARED_WEIGHTS_MARGIN of the fastest, else the fastest."""
    best = fastest(times)
    shared = {k: t for k, t in times.items() if shares_weights(k, decode)}
    if shared:
        kernel = fastest(shared)
        if shared[kernel] <= (1 + SHARED_WEIGHTS_MARGIN) * times[best]:
            return kernel
    return best


def tune_threads(
    choice: LinearChoice,
    layer_shapes: Sequence[Shape],
    dtype: torch.dtype,
    measure: Measure,
    times: dict[str, dict[str, float]],
    threads: int,
) -> int:
    """1 when one thread runs both the decode and prefill passes clearly faster
    (``ONE_THREAD_MARGIN``) than ``threads`` threads, else ``threads``."""
    regimes = {
        "decode": (choice.decode, DECODE_ROWS, decode_pass_bytes()),
        "prefill": (choice.prefill, PREFILL_ROWS, DECODE_PASS_BYTES),
    }
    wins = []
    for regime, (kernel, rows, pass_bytes) in regimes.items():
        torch.set_num_threads(1)
        try:
            single = measure([kernel], decode_shapes(layer_shapes, dtype, pass_bytes), rows)[kernel]
        finally:
            torch.set_num_threads(threads)
        times[f"threads_{regime}"] = {f"{threads}": times[regime][kernel], "1": single}
        wins.append(single < ONE_THREAD_MARGIN * times[regime][kernel])
    return 1 if all(wins) else threads


def tune_quant_rows(layer_shapes: Sequence[Shape]) -> tuple[int, dict[str, dict[str, float]]]:
    """The row count from which a GGUF layer's dequantised tiles run faster than its int8 dot
    kernels, timed on (up to QUANT_TUNE_MAX_OUT rows of) the model's largest projection in Q4_K
    blocks (Q8_0 where its inputs are not whole Q4_K blocks), and the seconds per row count.
    Twice the last row count tried where the dot kernels win at all of them."""
    gen = torch.Generator().manual_seed(0)
    kind, parts = _quant_layer(layer_shapes, gen)
    # NOTE: as stored: an interleaved part runs its own kernel at every row count (so would time
    # the same kernel twice); the switch is the other parts'
    modes = {
        "dot": pack_quantized(parts, None, 1 << 30, interleave=False),
        "tiles": pack_quantized(parts, None, 1, interleave=False),
    }
    rows, times = _first_win(modes, "dot", "tiles", kind, gen)
    return rows or 2 * QUANT_SPLIT_ROWS[-1], times


def tune_quant_amx_rows(layer_shapes: Sequence[Shape]) -> tuple[int, dict[str, dict[str, float]]]:
    """The row count from which an interleaved GGUF layer runs faster on AMX-INT8 tiles than
    on the AVX kernels (0: at none of QUANT_SPLIT_ROWS, or no tiles here), timed as
    tune_quant_rows times its switch, on the layer interleaved, and the seconds per row count."""
    if not extension.quant_amx_available():
        return 0, {}
    gen = torch.Generator().manual_seed(0)
    kind, parts = _quant_layer(layer_shapes, gen, multiple=16)
    modes = {
        "avx": pack_quantized(parts, None, 1 << 30),
        "amx": pack_quantized(parts, None, 1 << 30, amx_rows=1),
    }
    rows, times = _first_win(modes, "avx", "amx", f"{kind}_x8", gen)
    return rows or 0, times


def _quant_layer(
    layer_shapes: Sequence[Shape], gen: torch.Generator, multiple: int = 1
) -> tuple[str, QuantizedParts]:
    """Up to QUANT_TUNE_MAX_OUT rows (a multiple of ``multiple``) of the largest projection,
    random, in Q4_K blocks (Q8_0 where its inputs are not whole Q4_K blocks)."""
    out, cols = max(layer_shapes, key=lambda s: s[0] * s[1])
    kind = "q4_k" if cols % 256 == 0 else "q8_0"
    rows = max(multiple, min(out, QUANT_TUNE_MAX_OUT) // multiple * multiple)
    block = quantize(torch.randn(rows, cols, generator=gen).mul_(0.02), kind)
    return kind, QuantizedParts((block,), (0,), block.shape[0], cols)


def _first_win(
    modes: dict, slow: str, fast: str, label: str, gen: torch.Generator
) -> tuple[int | None, dict[str, dict[str, float]]]:
    """The first of QUANT_SPLIT_ROWS at which layer ``modes[fast]`` is no slower than
    ``modes[slow]`` (None: at none), and the seconds of both per row count."""
    cols = modes[slow].in_features
    times: dict[str, dict[str, float]] = {}
    for rows in QUANT_SPLIT_ROWS:
        x = torch.randn(rows, cols, generator=gen)
        times[f"{label}_rows_{rows}"] = t = fastest_passes(
            {mode: (lambda layer=layer, x=x: layer(x)) for mode, layer in modes.items()}
        )
        if t[fast] <= t[slow]:
            return rows, times
    return None, times
