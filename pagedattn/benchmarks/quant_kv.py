"""KV cache quantization quality: ``bench quant --kv-cache-dtype X [X ...]``.

Against the model dtype's KV cache on the same model (bench_quant's fixed text and prompt set):
mean token NLL delta, greedy agreement (identical continuations, tokens before the first
divergence) and the median batch-1 decode step. KV dtypes:

- ``fp8_e4m3`` / ``fp8`` (per-layer scales computed from the first prefill's amax), ``fp8_e5m2``
  (scales 1.0, as vLLM's default): the engine's FP8 cache, kernels included;
- ``u8`` (asymmetric: a scale and min per token and KV head, OpenVINO GenAI's CPU KV cache): the
  engine's u8 cache (attention.u8), kernels included;
- ``int8`` (symmetric, one scale per token and KV head): measured here only, as
  quantize-dequantize on write into a cache of the model's dtype; it has no kernel, so its step
  time is not its own.
"""

from __future__ import annotations

import math

import torch

from pagedattn.attention import get_attn_backend
from pagedattn.attention.fp8 import FP8_DTYPES
from pagedattn.attention.u8 import U8_NAMES, U8_SCALE_BYTES
from pagedattn.benchmarks.bench_quant import (
    BLOCK_SIZE,
    PROMPTS,
    TEXT,
    SequenceRunner,
    agreement,
    evaluate,
)
from pagedattn.model.layers import PagedAttention
from pagedattn.model.loader import load_model

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


def run(args) -> int:
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
    ref_out, ref_nll, ref_step_s = rows["model"]
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
