"""Our paged models vs HF transformers on the same random weights (float32).

Tolerance: logits agree within atol=1e-4, rtol=1e-4 at every prefill and decode position, and
greedy decoding picks the same tokens for 8 steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedattn.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from pagedattn.model import load_model
from pagedattn.model.base import PagedCausalLM
from tests.model.paged_driver import PagedDriver
from tests.model.tiny import (
    make_tiny_gemma3,
    make_tiny_llama,
    make_tiny_mistral,
    make_tiny_qwen2,
    make_tiny_qwen3,
)

ATOL = RTOL = 1e-4
NUM_NEW_TOKENS = 8
PROMPT_LENS = (11, 6, 13)
# Sequence 2 is prefilled in chunks of 5 tokens, so its later chunks attend to a cached prefix
# and share steps with the other sequences' decodes.
MAX_CHUNK = (64, 64, 5)

MAKERS: dict[str, Callable[[Path], Path]] = {
    "llama": make_tiny_llama,
    "qwen2": make_tiny_qwen2,
    "qwen3": make_tiny_qwen3,
    "mistral": make_tiny_mistral,
    "gemma3": make_tiny_gemma3,
}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def checkpoint(request, tmp_path_factory) -> Path:
    return MAKERS[request.param](tmp_path_factory.mktemp(request.param))


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def generate_paged(
    model: PagedCausalLM, prompts: list[list[int]], block_size: int, backend: str = "torch"
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decode through the paged cache; returns all tokens and the logits of fed tokens."""
    driver = PagedDriver(model, block_size=block_size, backend=backend)
    tokens = [list(p) for p in prompts]
    fed = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(t) - len(p) < NUM_NEW_TOKENS for t, p in zip(tokens, prompts, strict=True)):
        active = [
            s for s in range(len(prompts)) if len(tokens[s]) - len(prompts[s]) < NUM_NEW_TOKENS
        ]
        chunks = [(s, tokens[s][fed[s] : fed[s] + MAX_CHUNK[s]]) for s in active]
        for (s, chunk), logits in zip(chunks, driver.step(chunks), strict=True):
            fed[s] += len(chunk)
            rows[s].append(logits)
            if fed[s] == len(tokens[s]):
                tokens[s].append(int(logits[-1].argmax()))
    return tokens, [torch.cat(r) for r in rows]


@pytest.mark.parametrize("block_size", [4])
def test_paged_logits_and_greedy_match_hf(checkpoint: Path, block_size: int) -> None:
    ours = load_model(str(checkpoint), "float32", "cpu", "torch").model
    hf = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = make_prompts(hf.config.vocab_size)
    tokens, our_logits = generate_paged(ours, prompts, block_size)
    for prompt, seq, logits in zip(prompts, tokens, our_logits, strict=True):
        fed = seq[:-1]
        with torch.no_grad():
            ref = hf(torch.tensor([fed])).logits[0].float()  # [len(fed), V]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)
        hf_greedy = ref[len(prompt) - 1 :].argmax(-1).tolist()
        assert seq[len(prompt) :] == hf_greedy


@pytest.mark.parametrize("block_size", [1, 16])
def test_gemma3_parity_independent_of_block_size(tmp_path: Path, block_size: int) -> None:
    path = make_tiny_gemma3(tmp_path)
    ours = load_model(str(path), "float32", "cpu", "torch").model
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    prompts = make_prompts(hf.config.vocab_size, seed=1)
    tokens, our_logits = generate_paged(ours, prompts, block_size)
    for seq, logits in zip(tokens, our_logits, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([seq[:-1]])).logits[0].float()
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)


def test_gemma3_kv_cache_groups(tmp_path: Path) -> None:
    model = load_model(str(make_tiny_gemma3(tmp_path)), "float32", "cpu", "torch").model
    assert model.layer_group == [0, 0, 1, 0]
    assert model.kv_cache_group_windows() == [4, None]
    sliding, full = model.kv_cache_groups(block_size=4)
    assert sliding.layer_names == ("layers.0", "layers.1", "layers.3")
    assert sliding.spec == SlidingWindowSpec(4, sliding_window=4)
    assert full.layer_names == ("layers.2",)
    assert full.spec == FullAttentionSpec(4)
    assert (model.num_layers, model.num_kv_heads, model.head_size) == (4, 2, 16)


def test_sliding_window_changes_gemma3_logits(tmp_path: Path) -> None:
    """Guards the parity test: a wider window must give different logits on long prompts."""
    narrow = load_model(str(make_tiny_gemma3(tmp_path / "a")), "float32", "cpu", "torch").model
    wide_path = make_tiny_gemma3(tmp_path / "b", sliding_window=64)
    wide = load_model(str(wide_path), "float32", "cpu", "torch").model
    prompt = make_prompts(128)[2]
    narrow_logits = PagedDriver(narrow).step([(0, prompt)])[0]
    wide_logits = PagedDriver(wide).step([(0, prompt)])[0]
    assert not torch.allclose(narrow_logits[-1], wide_logits[-1], atol=1e-3)


def test_bfloat16_load_tracks_float32(tmp_path: Path) -> None:
    path = str(make_tiny_llama(tmp_path))
    fp32 = load_model(path, "float32", "cpu", "torch").model
    bf16 = load_model(path, "bfloat16", "cpu", "torch").model
    assert bf16.dtype == torch.bfloat16
    prompt = make_prompts(128)[0]
    ref = PagedDriver(fp32).step([(0, prompt)])[0]
    got = PagedDriver(bf16).step([(0, prompt)])[0]
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
