"""Quantized weights: quality next to speed, against the same model unquantized.

    python -m pagedattn.benchmarks.bench_quant [--model M] [--dtype bfloat16] [--quantization int8]
        [--new-tokens 32] [--threads 2]
    python -m pagedattn.benchmarks.bench_quant --kv-cache-dtype fp8_e4m3 fp8_e5m2 int8 u8

For the reference (``--dtype``, the kernel tuner's plan) and the quantized model it prints:
greedy agreement on a fixed prompt set (identical continuations, and the share of tokens before
the first divergence), the mean token NLL (and perplexity) of a fixed text and its delta, and
batch-1 speed: the median decode-step time over the greedy runs and the weight bytes per step.

``--kv-cache-dtype X [X ...]`` measures KV cache quantization instead, against the model dtype's
KV cache on the same model (the same text and prompts): mean token NLL delta, greedy agreement
and the median batch-1 decode step. KV dtypes:

- ``fp8_e4m3`` / ``fp8`` (per-layer scales computed from the first prefill's amax), ``fp8_e5m2``
  (scales 1.0, as vLLM's default): the engine's FP8 cache, kernels included;
- ``u8`` (asymmetric: a scale and min per token and KV head, OpenVINO GenAI's CPU KV cache): the
  engine's u8 cache (attention.u8), kernels included;
- ``int8`` (symmetric, one scale per token and KV head): measured here only, as
  quantize-dequantize on write into a cache of the model's dtype; it has no kernel, so its step
  time is not its own.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from pagedattn.attention import AttentionMetadata, get_attn_backend
from pagedattn.attention.fp8 import FP8_DTYPES
from pagedattn.attention.u8 import U8_NAMES, U8_SCALE_BYTES
from pagedattn.cpu.features import describe_cpu
from pagedattn.model.base import PagedCausalLM
from pagedattn.model.layers import Linear, PagedAttention
from pagedattn.model.loader import load_model

PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "In machine learning, overfitting means",
)
TEXT = (
    "The history of computing is longer than the history of computing hardware and modern "
    "computing technology and includes the history of methods intended for pen and paper or for "
    "chalk and slate, with or without the aid of tables. Digital computing is intimately tied to "
    "the representation of numbers. But long before abstractions like the number arose, there "
    "were mathematical concepts to serve the purposes of civilization. These concepts are "
    "implicit in concrete practices such as one-to-one correspondence, the basis of counting, "
    "and comparison of quantities. Eventually, the concept of numbers became concrete and "
    "familiar enough for counting to arise, at times with sing-song mnemonics to teach "
    "sequences to others."
)
BLOCK_SIZE = 16


class SequenceRunner:
    """One sequence at a time through a model's paged cache (contiguous blocks)."""

    def __init__(self, model: PagedCausalLM, max_len: int) -> None:
        self.model = model
        backend = get_attn_backend(None, "cpu")
        self.num_blocks = -(-max_len // BLOCK_SIZE)
        self.kv_caches = [
            backend.allocate_kv_cache(
                self.num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_size, model.dtype, "cpu"
            )
            for _ in range(model.num_layers)
        ]
        self.num_groups = len(model.kv_cache_group_windows())

    @torch.inference_mode()
    def forward(self, tokens: list[int], start: int) -> torch.Tensor:
        """Feed ``tokens`` at positions start.. (cache holds 0..start); float32 logits [T, V]."""
        seq_len = start + len(tokens)
        blocks = list(range(-(-seq_len // BLOCK_SIZE)))
        metadata = [
            AttentionMetadata.build([len(tokens)], [seq_len], [blocks], BLOCK_SIZE)
            for _ in range(self.num_groups)
        ]
        hidden = self.model(
            torch.tensor(tokens), torch.arange(start, seq_len), self.kv_caches, metadata
        )
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
        """Greedy continuation and the time of each decode step (seconds)."""
        nxt = int(self.forward(prompt, 0)[-1].argmax())
        out, times = [nxt], []
        for i in range(num_new - 1):
            t0 = time.perf_counter()
            nxt = int(self.forward([nxt], len(prompt) + i)[-1].argmax())
            times.append(time.perf_counter() - t0)
            out.append(nxt)
        return out, times

    def mean_nll(self, tokens: list[int]) -> float:
        """Mean negative log-likelihood of tokens[1:] given their prefixes (one prefill)."""
        logprobs = torch.log_softmax(self.forward(tokens, 0)[:-1], dim=-1)  # [T - 1, V]
        target = torch.tensor(tokens[1:])
        return float(-logprobs.gather(1, target[:, None]).mean())


def weight_bytes(model: PagedCausalLM) -> int:
    """Bytes of the packed linear weights a decode step reads (int8 codes and scales included)."""
    total = 0
    packed = [m.decode for m in model.modules() if isinstance(m, Linear)]
    for p in [*packed, model.tied_head]:
        if p is None:
            continue
        tensors = (p.a if p.name != "onednn" else None, p.b)
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        if p.name == "onednn":
            total += p.out_features * p.in_features * p.a.element_size()
    return total


def evaluate(
    model: PagedCausalLM,
    prompts: list[list[int]],
    text: list[int],
    num_new: int,
    runner_cls=SequenceRunner,
):
    max_len = max(len(text), max(len(p) for p in prompts) + num_new) + BLOCK_SIZE
    runner = runner_cls(model, max_len)
    runner.greedy(prompts[0], 4)  # warm-up
    outputs, step_times = [], []
    for prompt in prompts:
        out, times = runner.greedy(prompt, num_new)
        outputs.append(out)
        step_times += times
    return outputs, runner.mean_nll(text), statistics.median(step_times)


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(continuations identical, mean share of tokens before the first divergence)."""
    same, shares = 0, []
    for a, b in zip(ref, got, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same += n == len(a)
        shares.append(n / len(a))
    return same, sum(shares) / len(shares)


# Simulated (fake-quantized on write) per-token-head formats; u8 is a real cache.
PER_TOKEN_HEAD = ("int8",)
KV_DTYPES = (*FP8_DTYPES, *PER_TOKEN_HEAD, *U8_NAMES)


def fake_quant_per_token_head(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [T, Hkv, D] quantized with one scale (u8: and zero point) per token and head, and back."""
    xf = x.float()
    if kind == "int8":
        scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127.0
        return ((xf / scale).round().clamp(-127, 127) * scale).to(x.dtype)
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = (hi - lo).clamp_min(1e-8) / 255.0
    zero = (-lo / scale).round()
    return (((xf / scale).round() + zero).clamp(0, 255) - zero).mul(scale).to(x.dtype)


class PerTokenHeadWrites:
    """Wraps a backend: K/V go through per-token-head int8/u8 quantization on their way in."""

    def __init__(self, backend, kind: str) -> None:
        self.backend, self.kind = backend, kind

    def reshape_and_cache(self, key, value, *args, **kwargs) -> None:
        key = fake_quant_per_token_head(key, self.kind)
        value = fake_quant_per_token_head(value, self.kind)
        self.backend.reshape_and_cache(key, value, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


class KVRunner(SequenceRunner):
    """SequenceRunner over a KV cache of ``kv_dtype`` (fp8, u8, or the model's dtype)."""

    def __init__(self, model, max_len: int, kv_dtype: torch.dtype) -> None:
        self.model = model
        backend = get_attn_backend(None, "cpu")
        self.num_blocks = -(-max_len // BLOCK_SIZE)
        self.kv_caches = [
            backend.allocate_kv_cache(
                self.num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_size, kv_dtype, "cpu"
            )
            for _ in range(model.num_layers)
        ]
        self.num_groups = len(model.kv_cache_group_windows())


def configure(model, name: str) -> tuple[torch.dtype, list]:
    """Set the model's attention layers up for KV dtype ``name``; (cache dtype, the layers)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    for layer in layers:
        base = getattr(layer.backend, "backend", layer.backend)
        layer.backend = PerTokenHeadWrites(base, name) if name in PER_TOKEN_HEAD else base
        layer.k_scale = layer.v_scale = 1.0
        # NOTE: e4m3 with scales from the first prefill (vLLM's --calculate-kv-scales); e5m2's
        # range needs none (vLLM's default scales are 1.0).
        layer.calculate_kv_scales = name in ("fp8", "fp8_e4m3")
    if name in U8_NAMES:
        return torch.uint8, layers
    return FP8_DTYPES.get(name, model.dtype), layers


def run_kv(args) -> int:
    """Rows per KV dtype against the model dtype's KV; returns the exit status."""
    ref = load_model(args.model, args.dtype, "cpu")
    tok, model = ref.tokenizer, ref.model
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    text = tok.encode(TEXT, add_special_tokens=False)
    rows = {}
    for name in ("model", *args.kv_cache_dtype):
        dtype, _ = configure(model, name)
        outputs, nll, step_s = evaluate(
            model,
            prompts,
            text,
            args.new_tokens,
            runner_cls=lambda m, n, d=dtype: KVRunner(m, n, d),
        )
        rows[name] = (outputs, nll, step_s)
    ref_out, ref_nll, _ = rows["model"]
    print(
        f"model {ref.model_name} ({args.dtype}); {len(prompts)} prompts x {args.new_tokens} "
        f"greedy tokens; NLL over {len(text) - 1} tokens of a fixed text; reference: "
        f"{args.dtype} KV (mean NLL {ref_nll:.4f})"
    )
    n = args.new_tokens
    print("\n| KV cache | bytes/elem | NLL delta | identical continuations | tokens before "
          "first divergence | decode step ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, (outputs, nll, step_s) in rows.items():
        same, share = agreement(ref_out, outputs)
        nbytes = model.dtype.itemsize if name == "model" else 1
        if name in U8_NAMES:
            nbytes = f"1 + {U8_SCALE_BYTES}/{model.head_size}"
        step = f"{step_s * 1e3:.1f}" if name not in PER_TOKEN_HEAD else "- (no kernel)"
        label = f"{args.dtype} (reference)" if name == "model" else name
        print(f"| {label} | {nbytes} | {nll - ref_nll:+.4f} | {same}/{len(prompts)} | "
              f"{share * n:.1f} of {n} ({share:.0%}) | {step} |")  # fmt: skip
    print(f"\nper-token-head int8/u8 also store a scale per token and head (u8: and a min), "
          f"fp32: +{4 / model.head_size:.3f} (u8 +{U8_SCALE_BYTES / model.head_size:.3f}) bytes "
          "per element")  # fmt: skip
    return 0 if math.isfinite(ref_nll) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--quantization", default="int8", choices=("int8",))
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=("fp8", "fp8_e4m3", "fp8_e5m2", "int8", "u8"),
        help="compare KV cache dtypes against the model dtype's KV instead of weights",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"machine: {describe_cpu()}")
    if args.kv_cache_dtype:
        return run_kv(args)
    ref = load_model(args.model, args.dtype, "cpu")
    quant = load_model(args.model, args.dtype, "cpu", quantization=args.quantization)
    tok = ref.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    text = tok.encode(TEXT, add_special_tokens=False)
    rows = {}
    for name, loaded in ((args.dtype, ref), (f"{args.quantization} ({args.dtype})", quant)):
        outputs, nll, step_s = evaluate(loaded.model, prompts, text, args.new_tokens)
        rows[name] = (outputs, nll, step_s, weight_bytes(loaded.model))
    (ref_out, ref_nll, _, _), (q_out, q_nll, _, _) = rows.values()
    same, share = agreement(ref_out, q_out)
    print(
        f"model {ref.model_name}; {len(prompts)} prompts x {args.new_tokens} greedy tokens; "
        f"NLL over {len(text) - 1} tokens of a fixed text"
    )
    print("\n| weights | batch-1 decode step ms | weight MiB | mean NLL | perplexity |")
    print("|---|---|---|---|---|")
    for name, (_, nll, step_s, nbytes) in rows.items():
        print(
            f"| {name} | {step_s * 1e3:.1f} | {nbytes / 2**20:.0f} | {nll:.4f} | "
            f"{math.exp(nll):.2f} |"
        )
    print(
        f"\ngreedy agreement: {same}/{len(prompts)} continuations identical, "
        f"{share:.1%} of tokens before the first divergence; NLL delta {q_nll - ref_nll:+.4f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
