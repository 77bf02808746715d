"""TextConfig holds what transformers' config holds, for every architecture we build."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoConfig

from pagedattn.model.text_config import ModelConfigError, TextConfig

# model_type -> overrides that exercise its optional fields.
CASES = {
    "llama": {"head_dim": None, "attention_bias": True, "mlp_bias": True},
    "mistral": {"sliding_window": 5},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096},
    "qwen3": {"tie_word_embeddings": True},
    "gemma3_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
        "attn_logit_softcapping": 30.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
}
_BASE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "eos_token_id": [2, 3],
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_fields_equal_transformers_config(model_type: str) -> None:
    hf = AutoConfig.for_model(model_type, **(_BASE | CASES[model_type]))
    # NOTE: through JSON, as the GGUF loader's cache stores it.
    config = TextConfig.from_dict(json.loads(json.dumps(hf.to_dict())))
    for field in dataclasses.fields(TextConfig):
        want = getattr(hf, field.name, None)
        want = tuple(want) if field.name == "layer_types" and want is not None else want
        default = field.default if field.default is not dataclasses.MISSING else None
        assert getattr(config, field.name) == (default if want is None else want), field.name


def test_llama_head_dim_defaults_to_hidden_over_heads() -> None:
    raw = AutoConfig.for_model("llama", **(_BASE | {"head_dim": None})).to_dict()
    raw.pop("head_dim")
    assert TextConfig.from_dict(raw).head_dim == 16


def test_missing_value_is_named() -> None:
    raw = AutoConfig.for_model("llama", **_BASE).to_dict()
    del raw["rope_parameters"], raw["hidden_size"]
    with pytest.raises(ModelConfigError, match="hidden_size.*rope_parameters"):
        TextConfig.from_dict(raw)
