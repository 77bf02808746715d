"""TextConfig: the decoder hyper-parameters the model code reads, from a config.json dict.

The dict is what transformers' ``PreTrainedConfig.to_dict()`` gives (defaults filled in, rope
parameters standardised), so a repeat start can build the model without importing transformers.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any


class ModelConfigError(ValueError):
    """A config dict lacks a value the model code needs."""


@dataclass(frozen=True)
class TextConfig:
    """A text decoder's hyper-parameters (HF config.json names; optional ones default here)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # One standardised dict ({"rope_type", "rope_theta", ...}), or one per layer type (Gemma 3).
    rope_parameters: dict[str, Any]
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TextConfig:
        """The config of a (text) config.json dict; ModelConfigError names a missing value."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        heads = values.get("num_attention_heads")
        if "head_dim" not in values and heads and "hidden_size" in values:
            values["head_dim"] = values["hidden_size"] // heads
        if "num_key_value_heads" not in values and heads:
            values["num_key_value_heads"] = heads
        if "layer_types" in values:
            values["layer_types"] = tuple(values["layer_types"])
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
        if missing:
            raise ModelConfigError(
                f"the model config (model_type={raw.get('model_type')!r}) lacks {missing}: "
                "pagedattn needs them to build the model"
            )
        return cls(**values)
