"""Paging never changes the math: greedy tokens equal HF transformers' on the same weights.

Every engine configuration below (block sizes, prefix caching, preemption, chunked prefill, late
arrivals) must give exactly the tokens of a plain HF forward loop in float32.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedattn import LLM, SamplingParams
from tests.model.tiny import make_tiny_gemma3, make_tiny_llama

NUM_NEW_TOKENS = 8
PROMPT_LENS = (3, 16, 17, 33, 40)


def _prompts(vocab_size: int, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab_size, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.inference_mode()
def hf_greedy(model_dir, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """Greedy decoding with a full HF forward per token (no cache): the reference."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        new = []
        for _ in range(num_new):
            nxt = int(model(ids).logits[0, -1].argmax())
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        outs.append(new)
    return outs


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tmp_path_factory):
    maker = make_tiny_llama if request.param == "llama" else make_tiny_gemma3
    path = maker(tmp_path_factory.mktemp(request.param))
    vocab = AutoModelForCausalLM.from_pretrained(path).config.vocab_size
    prompts = _prompts(vocab)
    return path, prompts, hf_greedy(path, prompts, NUM_NEW_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)

CONFIGS = {
    "default": {},
    "block_size_1": {"block_size": 1},
    "block_size_32": {"block_size": 32},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    # A request computes at most 5 tokens a step: prompts run beside each other in pieces.
    "long_prefill_cap": {"long_prefill_token_threshold": 5},
    "torch_backend": {"attn_backend": "torch"},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf(tiny, name):
    path, prompts, expected = tiny
    llm = LLM(path, dtype="float32", num_blocks=256, **CONFIGS[name])
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats.kv_cache_usage == 0.0
    if name == "chunked_prefill":
        # 8 tokens per step: the prompts alone take at least sum(lens) / 8 steps.
        assert stats.step_times.num_steps >= -(-sum(len(p) for p in prompts) // 8)
    if name == "long_prefill_cap":
        # 5 tokens of a prompt per step: the longest prompt takes len / 5 steps, then decodes.
        num_prefill_steps = -(-max(len(p) for p in prompts) // 5)
        assert stats.step_times.num_steps >= num_prefill_steps + NUM_NEW_TOKENS - 1


def test_preemption_keeps_tokens(tiny):
    path, prompts, expected = tiny
    # Blocks of 4: the first three prompts take 1 + 4 + 5 blocks and grow to 3 + 6 + 7 while
    # decoding, more than the 13 usable blocks (block 0 is the null block): preemption. Gemma 3's
    # sliding-window group needs up to 6 more blocks per request (window 4, 16-token steps).
    num_blocks = 20 if "gemma" in str(path) else 14
    llm = LLM(path, dtype="float32", num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_recomputed_tokens > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats.num_preemptions
    assert stats.kv_cache_usage == 0.0


def test_prefix_cache_hits_keep_tokens(tiny):
    path, prompts, expected = tiny
    llm = LLM(path, dtype="float32", num_blocks=256, block_size=4)
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert [o.outputs[0].token_ids for o in first] == expected
    # Every block-aligned prefix (short of the last token) is served from cache the second time.
    for prompt, out in zip(prompts, again, strict=True):
        assert out.num_cached_tokens == (len(prompt) - 1) // 4 * 4
    assert llm.get_stats().prefix_cache_hits > 0


def test_requests_arriving_while_others_decode(tiny):
    path, prompts, expected = tiny
    llm = LLM(path, dtype="float32", num_blocks=256)
    engine = llm.engine
    done = {}
    for i in (0, 1):
        engine.add_request(str(i), prompts[i], GREEDY)
    for _ in range(3):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for i in range(2, len(prompts)):
        engine.add_request(str(i), prompts[i], GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == expected
    assert engine.get_stats().kv_cache_usage == 0.0
