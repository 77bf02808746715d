"""A decode step's matmuls alone: F.linear against MKL's and oneDNN's packed GEMMs and the panels.

    python -m pagedattn.benchmarks.bench_linear [--rows 1,8,32,128] [--layers 30] [--threads 2]

SmolLM2-135M's shapes (fused qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576, and
the 576->49,152 LM head), with ``--layers`` distinct random weight sets so that, as in the real
model, the weights stream from memory instead of sitting in cache. Each kernel computes the
same products; the median of ``--reps`` passes is reported, with the speed-up over F.linear.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedattn.benchmarks.pagedattn_runner import median_time
from pagedattn.model.packed_linear import (
    PackedLinear,
    mkl_packing_available,
    onednn_available,
    pack_panels,
    pack_weight,
    packed_linear,
    panel_kernel_available,
    panel_linear,
)

# (out_features, in_features) of one SmolLM2 layer's projections, then the LM head.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


def kernels(weights: list[torch.Tensor]) -> dict[str, list]:
    """Kernel name -> one callable per weight (x -> x @ w.T), each over its own packed copy."""
    out: dict[str, list] = {"F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
    if mkl_packing_available():
        out["MKL packed"] = [
            lambda x, w=w, p=pack_weight(w): packed_linear(x, p, w, None) for w in weights
        ]
    if panel_kernel_available():
        for name, dtype in (
            ("panels fp32", torch.float32),
            ("panels bf16 weights", torch.bfloat16),
        ):
            out[name] = [
                lambda x, n=w.shape[0], p=pack_panels(w.to(dtype)): panel_linear(x, p, n, None)
                for w in weights
            ]
    if onednn_available(torch.float32):
        out["oneDNN fp32"] = [PackedLinear("onednn", w, None) for w in weights]
    if onednn_available(torch.bfloat16):
        # NOTE: bf16 activations and weights (AMX tiles where the CPU has them); the casts of
        # x and of the result are part of the time.
        out["oneDNN bf16"] = [
            lambda x, p=PackedLinear("onednn", w.bfloat16(), None): p(x.bfloat16()).float()
            for w in weights
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128", help="comma list of batch rows (tokens)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=HEAD_SHAPE[0], help="LM head rows")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    shapes = LAYER_SHAPES * args.layers + [(args.vocab, HEAD_SHAPE[1])]
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    fns = kernels(weights)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    names = list(fns)
    print(f"{args.layers} layers + LM head, {args.threads} threads, median of {args.reps}")
    print("\n| rows | " + " | ".join(f"{n} ms" for n in names) + " | fastest / F.linear |")
    print("|---" * (len(names) + 2) + "|")
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.randn(m, k) for k in {k for _, k in shapes}}
            times = {}
            for name in names:

                def one_pass(calls=fns[name], xs=xs) -> None:
                    for (_, k), call in zip(shapes, calls, strict=True):
                        call(xs[k])

                one_pass()  # warm-up
                times[name] = median_time(one_pass, args.reps)
            best = min(times.values())
            cells = " | ".join(f"{times[n] * 1e3:.1f}" for n in names)
            print(f"| {m} | {cells} | {times['F.linear'] / best:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
