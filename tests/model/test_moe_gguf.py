"""Qwen3-MoE GGUF files (llama.cpp's qwen3moe: stacked expert tensors, an F32 router): greedy
float32 tokens equal HF's from an F32 file, and the experts of a Q8_0 file run as stored."""

from __future__ import annotations

import re

import pytest

from pagedattn import LLM
from pagedattn.cpu import extension
from pagedattn.model import load_model
from pagedattn.model.moe import SparseMoEBlock
from tests.engine.test_greedy_parity import GREEDY, _prompts, hf_greedy
from tests.model.gguf_writer import write_gguf
from tests.model.paged_driver import PagedDriver
from tests.model.test_moe_parity import make_tiny_mixtral, make_tiny_qwen3_moe
from tests.model.tiny import TINY_VOCAB_SIZE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE (every layer sparse, as llama.cpp runs qwen3moe) and its F32 and Q8_0
    GGUF files."""
    root = tmp_path_factory.mktemp("moe-gguf")
    hf_dir = make_tiny_qwen3_moe(root, mlp_only_layers=[], num_hidden_layers=2)
    f32 = write_gguf(hf_dir, root / "tiny-moe.F32.gguf", "qwen3moe")
    q8 = write_gguf(hf_dir, root / "tiny-moe.Q8_0.gguf", "qwen3moe", q8_0=True)
    return hf_dir, f32, q8


def test_f32_gguf_greedy_matches_hf(tiny):
    hf_dir, f32, _ = tiny
    prompts = _prompts(TINY_VOCAB_SIZE)
    expected = hf_greedy(hf_dir, prompts, 8)
    llm = LLM(str(f32), dtype="float32", num_blocks=256)
    assert llm.engine.runner.model.architecture == "Qwen3MoeForCausalLM"
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_mixtral_gguf_greedy_matches_hf(tmp_path):
    """A llama GGUF with experts is Mixtral: Q/K rows in llama.cpp's order, w1/w3/w2 stacks."""
    hf_dir = make_tiny_mixtral(tmp_path)
    f32 = write_gguf(hf_dir, tmp_path / "tiny-mixtral.F32.gguf", "llama")
    prompts = _prompts(TINY_VOCAB_SIZE)
    llm = LLM(str(f32), dtype="float32", num_blocks=256)
    assert llm.engine.runner.model.architecture == "MixtralForCausalLM"
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_dir, prompts, 8)


@pytest.mark.skipif(extension.get_extension() is None, reason="the gguf kernel is compiled")
def test_q8_0_experts_run_as_stored(tiny, capsys):
    _, _, q8 = tiny
    quant = load_model(str(q8), "float32", "cpu", "torch")
    # embedding, LM head, 2 x (4 attention projections + 3 expert stacks); routers stay F32.
    # One line per layout: interleaved 8 rows, and as stored (the looked-up table, 8n rows or not)
    counts = re.findall(r"^\[weights\] Q8_0 x (\d+): ", capsys.readouterr().err, re.MULTILINE)
    assert len(counts) >= 1 and sum(map(int, counts)) == 16, counts
    blocks = [m for m in quant.model.modules() if isinstance(m, SparseMoEBlock)]
    assert len(blocks) == 2
    for block in blocks:
        assert block.fused is not None and not block.quantized
        assert {p.name for group in block.packed for p in group} == {"gguf"}
        assert block.experts.gate_up_proj.numel() == 0  # no float copy of the experts
    # The same blocks widened to float32: only the int8 activations differ (as llama.cpp's), so
    # each position's logits stay close but where a token's top-k experts flip.
    ref = load_model(str(q8), "float32", "cpu", "torch", weights="dequantize")
    prompt = [3 + i % 37 for i in range(40)]
    a = PagedDriver(quant.model, block_size=16).step([(0, prompt)])[0]
    b = PagedDriver(ref.model, block_size=16).step([(0, prompt)])[0]
    errors = (a - b).norm(dim=-1) / b.norm(dim=-1)
    assert errors.median() < 0.03 and (errors > 0.1).sum() <= 4, errors
