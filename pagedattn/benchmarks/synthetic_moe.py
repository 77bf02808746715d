"""The MoE part of synthetic checkpoints: a Qwen3-MoE layout (router, per-expert SwiGLU, q/k
norm) for shapes with ``num_experts`` (synthetic.py builds them), and llama.cpp's qwen3moe layout
of the same numbers for the GGUF files (each projection's experts stacked into one tensor)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedattn.benchmarks.synthetic import SyntheticShape


def moe_layer_specs(shape: SyntheticShape, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, GGUF name or "" for an expert's, shape) of layer ``layer``'s q/k norms, router
    and experts."""
    hf, h, inter = f"model.layers.{layer}.", shape.hidden_size, shape.moe_intermediate_size
    gg = f"blk.{layer}."
    specs = [
        (hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight", (shape.head_dim,)),
        (hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight", (shape.head_dim,)),
        (hf + "mlp.gate.weight", gg + "ffn_gate_inp.weight", (shape.num_experts, h)),
    ]
    for e in range(shape.num_experts):
        expert = f"{hf}mlp.experts.{e}."
        specs += [
            (expert + "gate_proj.weight", "", (inter, h)),
            (expert + "up_proj.weight", "", (inter, h)),
            (expert + "down_proj.weight", "", (h, inter)),
        ]
    return specs


def expert_stacks(
    shape: SyntheticShape, layer: int
) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """(GGUF name, shape [E, out, in], the experts' HF names) of layer ``layer``'s stacked
    expert tensors, as llama.cpp's qwen3moe stores them."""
    hf, h, inter = f"model.layers.{layer}.", shape.hidden_size, shape.moe_intermediate_size
    stacks = []
    for proj, gguf_name, dims in (
        ("gate_proj", "ffn_gate_exps", (inter, h)),
        ("up_proj", "ffn_up_exps", (inter, h)),
        ("down_proj", "ffn_down_exps", (h, inter)),
    ):
        names = [f"{hf}mlp.experts.{e}.{proj}.weight" for e in range(shape.num_experts)]
        stacks.append((f"blk.{layer}.{gguf_name}.weight", (shape.num_experts, *dims), names))
    return stacks


def moe_config(shape: SyntheticShape, config: dict) -> dict:
    """A Llama config.json dict of ``shape`` turned into Qwen3-MoE's (every layer sparse)."""
    return config | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }
