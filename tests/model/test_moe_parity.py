"""Qwen3-MoE and Mixtral on the paged engine: greedy float32 tokens equal HF transformers'.

The same engine configurations as the dense parity tests (tests/engine/test_greedy_parity.py):
block sizes, prefix caching, chunked prefill, a prefill cap, the torch backend, preemption.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedattn import LLM
from pagedattn.model.moe import SparseMoEBlock
from tests.engine.test_greedy_parity import CONFIGS, GREEDY, _prompts, hf_greedy
from tests.model.tiny import TINY_VOCAB_SIZE, make_tiny_checkpoint

NUM_NEW_TOKENS = 8


def make_tiny_qwen3_moe(tmp_path: Path, **overrides: Any) -> Path:
    """Tiny Qwen3-MoE: 3 layers, the middle one dense (mlp_only_layers), 8 experts, top-2
    renormalised (norm_topk_prob), q/k norm, untied head."""
    kwargs = {
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    } | overrides
    return make_tiny_checkpoint(
        tmp_path / "tiny-qwen3-moe", "qwen3_moe", "Qwen3MoeForCausalLM", **kwargs
    )


def make_tiny_mixtral(tmp_path: Path, **overrides: Any) -> Path:
    """Tiny Mixtral: 4 experts of FFN 32, top-2, every layer sparse."""
    kwargs = {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    } | overrides
    return make_tiny_checkpoint(
        tmp_path / "tiny-mixtral", "mixtral", "MixtralForCausalLM", **kwargs
    )


MAKERS = {"qwen3_moe": make_tiny_qwen3_moe, "mixtral": make_tiny_mixtral}


@pytest.fixture(scope="module", params=list(MAKERS))
def tiny_moe(request, tmp_path_factory):
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param))
    prompts = _prompts(TINY_VOCAB_SIZE)
    return path, prompts, hf_greedy(path, prompts, NUM_NEW_TOKENS)


# NOTE: the configurations that exercise paging most stay in the default suite; the rest are slow.
_FAST = ("default", "block_size_1", "chunked_prefill")
_PARAMS = [n if n in _FAST else pytest.param(n, marks=pytest.mark.slow) for n in CONFIGS]


@pytest.mark.parametrize("name", _PARAMS)
def test_moe_greedy_matches_hf(tiny_moe, name):
    path, prompts, expected = tiny_moe
    llm = LLM(path, dtype="float32", num_blocks=256, **CONFIGS[name])
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_stats().kv_cache_usage == 0.0


def test_moe_packed_experts_keep_tokens(tiny_moe):
    """Experts (and router) packed for the compiled panels kernel: HF's tokens still."""
    from pagedattn.cpu.linear import kernel_available

    if not kernel_available("panels", torch.float32):
        pytest.skip("the panels kernel is not built here")
    path, prompts, expected = tiny_moe
    llm = LLM(path, dtype="float32", num_blocks=256, linear_kernel="panels")
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoEBlock)]
    assert blocks and all(b.packed is not None and b.router is not None for b in blocks)
    assert all(b.fused is not None for b in blocks)  # the fused C++ block runs them
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


def test_moe_preemption_keeps_tokens(tiny_moe):
    path, prompts, expected = tiny_moe
    llm = LLM(path, dtype="float32", num_blocks=14, block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.get_stats().num_preemptions > 0


def test_moe_prefix_cache_hits_keep_tokens(tiny_moe):
    path, prompts, expected = tiny_moe
    llm = LLM(path, dtype="float32", num_blocks=256, block_size=4)
    llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert llm.get_stats().prefix_cache_hits > 0


def test_qwen3_moe_layers_follow_config(tmp_path):
    """decoder_sparse_step and mlp_only_layers pick the sparse layers as HF does."""
    from transformers import AutoModelForCausalLM

    from pagedattn.model.loader import load_model
    from pagedattn.model.moe import SparseMoEBlock

    path = make_tiny_qwen3_moe(tmp_path, num_hidden_layers=4, decoder_sparse_step=2)
    hf = AutoModelForCausalLM.from_pretrained(path)
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    model = load_model(str(path)).model
    ours = [isinstance(layer.mlp, SparseMoEBlock) for layer in model.model.layers]
    # (i + 1) % 2 == 0 gives layers 1 and 3; mlp_only_layers=[1] keeps layer 1 dense.
    assert ours == hf_sparse == [False, False, False, True]


def test_moe_ngram_speculation_keeps_tokens(tiny_moe):
    path, prompts, expected = tiny_moe
    llm = LLM(
        path, dtype="float32", num_blocks=256, speculative_method="ngram", num_speculative_tokens=3
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected


@pytest.mark.slow
def test_moe_lora_on_attention_matches_hf_peft(tmp_path):
    """An adapter of the attention projections runs on an MoE model as on a dense one."""
    from pagedattn import LoRARequest
    from tests.lora.adapters import hf_peft_greedy, make_peft_adapter

    base = make_tiny_qwen3_moe(tmp_path)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapter = make_peft_adapter(base, tmp_path / "adapter", rank=8, seed=1, targets=targets)
    prompt = list(range(5, 16))
    expected = hf_peft_greedy(base, adapter, prompt, NUM_NEW_TOKENS)
    assert expected != hf_peft_greedy(base, None, prompt, NUM_NEW_TOKENS)
    llm = LLM(base, dtype="float32", num_blocks=64, block_size=4, enable_lora=True, max_loras=1)
    out = llm.generate([prompt], GREEDY, lora_request=[LoRARequest("a", 1, str(adapter))])
    assert out[0].outputs[0].token_ids == expected
