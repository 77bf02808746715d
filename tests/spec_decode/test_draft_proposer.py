"""A draft model with the target's tokenizer proposes on its own paged cache: greedy output stays
plain decoding's, and a draft identical to the target has every draft accepted."""

from __future__ import annotations

import pytest

from pagedattn import LLM, SamplingParams
from tests.model.tiny import make_tiny_checkpoint, make_tiny_llama

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 2 + [5], [40, 41, 42, 43, 44, 45, 46], list(range(20, 39))]
COMMON = {"dtype": "float32", "num_blocks": 128, "block_size": 4}
SPEC = {
    "speculative_method": "draft",
    "num_speculative_tokens": 3,
    "speculative_disable_by_batch_size": 8,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_llama(root)
    # Another model (other weights, one layer) with the same tokenizer: a real draft.
    other = make_tiny_checkpoint(
        root / "tiny-draft", "llama", "LlamaForCausalLM", seed=5, num_hidden_layers=1
    )
    return target, other


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_draft_model_keeps_greedy_output(models):
    target, other = models
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = _tokens(LLM(target, **COMMON), params)
    same = LLM(target, **COMMON, **SPEC, draft_model=str(target))
    assert _tokens(same, params) == expected
    stats = same.get_stats().spec_decode
    # The draft is the target itself: its cache must hold exactly what the target's holds.
    assert stats.num_draft_tokens > 20 and stats.acceptance_rate > 0.95
    drafted = LLM(target, **COMMON, **SPEC, draft_model=str(other))
    assert _tokens(drafted, params) == expected
    assert drafted.get_stats().spec_decode.num_draft_tokens > 20
    # Every draft-side sequence is freed when its request ends.
    proposer = drafted.engine.speculator.proposer
    assert not proposer.seqs
    assert proposer.manager.num_free_blocks == proposer.manager.num_usable_blocks
