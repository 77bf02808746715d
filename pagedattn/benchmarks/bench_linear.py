"""A decode step's matmuls alone: F.linear against the packed GEMMs, the panels and AMX tiles.

    python -m pagedattn.benchmarks.bench_linear [--rows 1,8,32,128] [--layers 30] [--threads 2]
        [--kernels "F.linear,AMX bf16,int8 weight-only,int8 W8A8 oneDNN"]

SmolLM2-135M's shapes (fused qkv 576->960, o 576->576, gate/up 576->3072, down 1536->576, and
the 576->49,152 LM head), with ``--layers`` distinct random weight sets so that, as in the real
model, the weights stream from memory instead of sitting in cache. Each kernel computes the
same products; the median of ``--reps`` passes is reported, with the speed-up over F.linear.

The int8 columns compare ``--quantization int8``'s kernels: per-channel int8 weights through
torch's weight-only ``_weight_int8pack_mm`` ("int8 weight-only") and through the AMX kernel
("int8 AMX": each tile widened to bf16 in L1), both with bf16 activations (the engine measures
the two and runs the faster), against oneDNN's int8 GEMM with the activations quantized too
(``onednn::qlinear_pointwise``, AMX-INT8 where the CPU has it; per-tensor scale computed in the
timed call, bf16 output), measured here and not an engine kernel; so is torch's int4
weight-only kernel (asymmetric, groups of 32 along K), to see whether int4 would pay.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedattn.benchmarks.pagedattn_runner import median_time
from pagedattn.cpu.features import has_int8_dot_hardware
from pagedattn.cpu.linear import INT8_MAX, kernel_available, pack_weight, quantize_int8

# (out_features, in_features) of one SmolLM2 layer's projections, then the LM head.
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


def kernels(weights: list[torch.Tensor], wanted: frozenset[str] = frozenset()) -> dict[str, list]:
    """Kernel name -> one callable per weight (x -> x @ w.T), each over its own packed copy.
    wanted: names asked for by --kernels (a kernel left out by default is added when named)."""
    out: dict[str, list] = {"F.linear": [lambda x, w=w: F.linear(x, w) for w in weights]}
    if kernel_available("mkl", torch.float32):
        out["MKL packed"] = [pack_weight("mkl", w) for w in weights]
    if kernel_available("panels", torch.float32):
        out["panels fp32"] = [pack_weight("panels", w) for w in weights]
        out["panels bf16 weights"] = [
            lambda x, p=pack_weight("panels", w.bfloat16()): p(x) for w in weights
        ]
    if kernel_available("onednn", torch.float32):
        out["oneDNN fp32"] = [pack_weight("onednn", w) for w in weights]
    if kernel_available("onednn", torch.bfloat16):
        # NOTE: bf16 activations and weights (AMX tiles where the CPU has them); the casts of
        # x and of the result are part of the time.
        out["oneDNN bf16"] = [
            lambda x, p=pack_weight("onednn", w.bfloat16()): p(x.bfloat16()).float()
            for w in weights
        ]
    if kernel_available("amx", torch.bfloat16):
        # NOTE: a weight that is not whole tiles runs what the engine would run in its place.
        for name, kernel in (("AMX bf16", "amx"), ("int8 AMX", "int8_amx")):
            packed = [pack_weight(kernel, w.bfloat16()) for w in weights]
            out[name] = [lambda x, p=p: p(x.bfloat16()).float() for p in packed]
    out["int8 weight-only"] = [
        lambda x, p=pack_weight("int8", w.bfloat16()): p(x.bfloat16()).float() for w in weights
    ]
    # NOTE: without VNNI oneDNN's int8 GEMM is no contender: at the AVX2 cap on the AMX Xeon it
    # took ~45 s for 32 rows (30 layers), three quarters of a default run.
    w8a8 = "int8 W8A8 oneDNN"
    if hasattr(torch.ops.onednn, "qlinear_pointwise") and (
        has_int8_dot_hardware() or w8a8 in wanted
    ):
        out[w8a8] = [W8A8(w) for w in weights]
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and all(
        w.shape[0] % INT4_GROUP == 0 and w.shape[1] % (2 * INT4_GROUP) == 0 for w in weights
    ):
        out["int4 weight-only (torch)"] = [Int4(w) for w in weights]
    return out


INT4_GROUP = 32  # weights per scale/zero pair along K (torch's int4 kernel's group size)


class Int4:
    """x @ w.T with asymmetric int4 weights (a scale and zero per group of 32 along K) through
    torch's ``_weight_int4pack_mm_for_cpu``, bf16 activations (measured: does int4 pay?)."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        groups = weight.float().view(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp_(0, 15)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).view(n, k), 2
        )
        # NOTE: the kernel dequantises (q - 8) * scale + zero.
        zero = low + 8 * scale
        self.scales_zeros = torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), self.packed, INT4_GROUP, self.scales_zeros
        ).float()


class W8A8:
    """x @ w.T with int8 weights (per channel) and int8 activations (per tensor, quantized per
    call) through oneDNN's int8 GEMM; bf16 out (a measured alternative, not an engine kernel)."""

    def __init__(self, weight: torch.Tensor) -> None:
        q, scales = quantize_int8(weight)
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.scales = scales.float()
        self.zero_points = torch.zeros(q.shape[0], dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_scale = float(x.abs().amax()) / INT8_MAX or 1.0
        qx = torch.round(x / x_scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return torch.ops.onednn.qlinear_pointwise(
            qx,
            x_scale,
            0,
            self.packed,
            self.scales,
            self.zero_points,
            None,
            1.0,
            0,
            torch.bfloat16,
            "none",
            [],
            "",
        ).float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,8,32,128", help="comma list of batch rows (tokens)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=HEAD_SHAPE[0], help="LM head rows")
    p.add_argument(
        "--kernels",
        default="",
        help="comma list of kernel names (default: all, but int8 W8A8 oneDNN only where "
        "the CPU has VNNI or AMX-INT8)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    shapes = LAYER_SHAPES * args.layers + [(args.vocab, HEAD_SHAPE[1])]
    weights = [torch.randn(n, k) * 0.02 for n, k in shapes]
    wanted = [k.strip() for k in args.kernels.split(",") if k.strip()]
    fns = kernels(weights, frozenset(wanted))
    unknown = [k for k in wanted if k not in fns]
    if unknown:
        p.error(f"unknown or unavailable kernels {unknown}; here: {', '.join(fns)}")
    if wanted:
        fns = {k: fns[k] for k in ["F.linear", *wanted] if k in fns}
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    names = list(fns)
    from pagedattn.cpu.features import describe_cpu

    print(f"machine: {describe_cpu()}")
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
