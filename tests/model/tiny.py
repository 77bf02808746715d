"""Tiny random HF checkpoints (config.json + safetensors + tokenizer) for tests; no network.

Other test packages reuse these: ``from tests.model.tiny import make_tiny_llama``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PreTrainedTokenizerFast,
)

TINY_VOCAB_SIZE = 128
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
# Words of the tiny vocabulary after the special tokens: a few English ones, then w0, w1, ...
_WORDS = "the a of to and is in it you that he was for on are with as I his they be at one".split()


def tiny_vocab() -> dict[str, int]:
    """Token text -> id for the TINY_VOCAB_SIZE-token word-level vocabulary."""
    words = SPECIAL_TOKENS + _WORDS + ["user", "assistant", "system"]
    words += [f"w{i}" for i in range(TINY_VOCAB_SIZE - len(words))]
    return {w: i for i, w in enumerate(words)}


def save_tiny_tokenizer(path: Path) -> None:
    """A whitespace word-level tokenizer with a chat template, saved as tokenizer.json."""
    tok = Tokenizer(models.WordLevel(vocab=tiny_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def _perturb(model: torch.nn.Module, seed: int, std: float) -> None:
    # NOTE: HF's init leaves norms at 1 (or 0 for Gemma) and tiny linears; random offsets make
    # every weight matter, so a mis-mapped norm or a (1 + w) slip changes the logits.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * std)


def make_tiny_checkpoint(
    path: Path, model_type: str, architecture: str, seed: int = 0, **overrides: Any
) -> Path:
    """Save a random ``model_type`` checkpoint (float32 safetensors + tokenizer) to ``path``."""
    kwargs: dict[str, Any] = {
        "architectures": [architecture],
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    kwargs |= overrides
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb(model, seed, std=0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_tiny_tokenizer(path)
    return path


def make_tiny_llama(tmp_path: Path, **overrides: Any) -> Path:
    """Tiny Llama with GQA (4 query heads, 2 KV heads) and an untied LM head."""
    kwargs = {"tie_word_embeddings": False, "rope_theta": 10000.0} | overrides
    return make_tiny_checkpoint(tmp_path / "tiny-llama", "llama", "LlamaForCausalLM", **kwargs)


def make_tiny_qwen2(tmp_path: Path, **overrides: Any) -> Path:
    """Tiny Qwen2: q/k/v biases, tied embeddings."""
    kwargs = {"tie_word_embeddings": True} | overrides
    return make_tiny_checkpoint(tmp_path / "tiny-qwen2", "qwen2", "Qwen2ForCausalLM", **kwargs)


def make_tiny_qwen3(tmp_path: Path, **overrides: Any) -> Path:
    """Tiny Qwen3: per-head q/k RMSNorm, tied embeddings."""
    kwargs = {"tie_word_embeddings": True} | overrides
    return make_tiny_checkpoint(tmp_path / "tiny-qwen3", "qwen3", "Qwen3ForCausalLM", **kwargs)


def make_tiny_mistral(tmp_path: Path, **overrides: Any) -> Path:
    """Tiny Mistral with a 5-token sliding window on every layer."""
    kwargs = {"tie_word_embeddings": False, "sliding_window": 5} | overrides
    return make_tiny_checkpoint(
        tmp_path / "tiny-mistral", "mistral", "MistralForCausalLM", **kwargs
    )


def make_tiny_gemma3(tmp_path: Path, **overrides: Any) -> Path:
    """Tiny Gemma 3 text: 4 layers (sliding, sliding, global, sliding), window 4, capped logits.

    query_pre_attn_scalar differs from head_dim and the two rope thetas differ, and the global
    layers use linear rope scaling, so each of those code paths changes the logits.
    """
    kwargs = {
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        "sliding_window": 4,
        "query_pre_attn_scalar": 24,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 500.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "final_logit_softcapping": 5.0,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
    } | overrides
    return make_tiny_checkpoint(
        tmp_path / "tiny-gemma3", "gemma3_text", "Gemma3ForCausalLM", **kwargs
    )
