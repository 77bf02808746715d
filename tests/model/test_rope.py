"""Our rope frequencies equal transformers' ROPE_INIT_FUNCTIONS for every type we support."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedattn.model.layers import RotaryEmbedding
from pagedattn.model.rope import rope_frequencies
from pagedattn.model.text_config import TextConfig

_LLAMA = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
}
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn_no_truncate": {
        "rope_type": "yarn",
        "factor": 3.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 2048,
        "attention_factor": 0.8,
    },
}


@pytest.mark.parametrize("name", sorted(ROPE_SCALINGS))
def test_scaled_rope_matches_transformers(name: str) -> None:
    hf = AutoConfig.for_model("llama", rope_scaling=dict(ROPE_SCALINGS[name]), **_LLAMA)
    rope_type = hf.rope_parameters["rope_type"]
    want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    config = TextConfig.from_dict(hf.to_dict())
    got, got_scale = rope_frequencies(config.rope_parameters, 64, config.max_position_embeddings)
    assert got.dtype == torch.float32 and got.shape == (32,)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    assert got_scale == pytest.approx(want_scale, rel=1e-12)


def test_default_rope_matches_transformers_rotary_embedding() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = AutoConfig.for_model("llama", **_LLAMA)
    want = LlamaRotaryEmbedding(hf).inv_freq
    got = RotaryEmbedding(TextConfig.from_dict(hf.to_dict()), 64).inv_freq
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)


def test_gemma3_layer_types_get_their_own_rope() -> None:
    hf = AutoConfig.for_model(
        "gemma3_text",
        head_dim=32,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    config = TextConfig.from_dict(hf.to_dict())
    for layer_type in ("full_attention", "sliding_attention"):
        params = hf.rope_parameters[layer_type]
        if params["rope_type"] == "default":
            want = 1.0 / params["rope_theta"] ** (torch.arange(0, 32, 2).float() / 32)
        else:
            want, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu", layer_type=layer_type)
        got = RotaryEmbedding(config, 32, layer_type=layer_type).inv_freq
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    full = RotaryEmbedding(config, 32, layer_type="full_attention").inv_freq
    sliding = RotaryEmbedding(config, 32, layer_type="sliding_attention").inv_freq
    assert not torch.equal(full, sliding)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused(rope_type: str) -> None:
    with pytest.raises(NotImplementedError, match=rope_type):
        rope_frequencies({"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}, 64, 4096)
