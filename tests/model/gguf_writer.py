"""Write a tiny HF checkpoint as an F32 (or Q8_0) GGUF file the way llama.cpp's converter does."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file
from transformers import AutoConfig

from tests.model.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, TINY_VOCAB_SIZE, tiny_vocab

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
# An expert's projection (Qwen3-MoE's names, Mixtral's) -> llama.cpp's stacked tensor of all
# experts'.
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
_EXPERT_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)
_LLAMA_LAYER_NAMES = _LAYER_NAMES | {"post_attention_layernorm": "ffn_norm"}
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows for its interleaved rope."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A GPT-2 style byte-level BPE vocabulary of TINY_VOCAB_SIZE tokens, and its merges.

    The special tokens at tiny_vocab()'s ids, printable ASCII, space and newline in GPT-2's byte
    alphabet ("Ġ", "Ċ"), then merges spelling " the", " a", " of", ... until the vocabulary is
    full: a tokenizer transformers can convert from GGUF, that encodes plain English text.
    """
    tokens = SPECIAL_TOKENS + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
    merges: list[str] = []
    for word in list(tiny_vocab())[len(SPECIAL_TOKENS) :]:
        current = "Ġ"
        for char in word:
            if len(tokens) == TINY_VOCAB_SIZE:
                return tokens, merges
            merged = current + char
            if merged not in tokens:
                merges.append(f"{current} {char}")
                tokens.append(merged)
            current = merged
    raise AssertionError("the words ran out before the vocabulary was full")


def _gguf_name(hf_name: str, arch: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    _, _, layer, part = base.split(".", 3)
    names = _LLAMA_LAYER_NAMES if arch == "llama" else _LAYER_NAMES
    return f"blk.{layer}.{names[part]}.{kind}"


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF per-expert tensors replaced by llama.cpp's stacked [E, rows, cols] ones."""
    out, experts = {}, {}
    for name, w in tensors.items():
        match = _EXPERT_RE.fullmatch(name)
        if match is None:
            out[name] = w
            continue
        layer, expert, proj = match.groups()
        experts.setdefault((layer, proj), {})[int(expert)] = w
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        out[f"blk.{layer}.{_EXPERT_NAMES[proj]}.weight"] = stacked
    return out


def write_gguf(hf_dir: Path, out: Path, arch: str, q8_0: bool = False) -> Path:
    """Convert ``hf_dir`` (arch "llama", Mixtral's too, "gemma3" or "qwen3moe") into an F32 GGUF
    file at ``out``; q8_0: matrices (experts' too, not the router) as Q8_0 blocks."""
    config = AutoConfig.from_pretrained(hf_dir)
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    writer.add_rope_freq_base((rope["full_attention"] if arch == "gemma3" else rope)["rope_theta"])
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if arch == "qwen3moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "num_local_experts", None):  # Mixtral: a llama file with experts
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_tokenizer_model("gpt2")
    tokens, merges = byte_level_vocab()
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    tensors = {}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, config.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, config.num_key_value_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
    for name, w in _stack_experts(tensors).items():
        gguf_name = name if name.startswith("blk.") else _gguf_name(name, arch)
        if q8_0 and w.ndim >= 2 and "ffn_gate_inp" not in gguf_name and w.shape[-1] % 32 == 0:
            blocks = quantize(w, GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name, blocks, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
