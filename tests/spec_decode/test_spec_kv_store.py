"""The KV store never receives a rejected draft's K/V: every saved block is a block of accepted
tokens, and an engine that loads them continues exactly as one that computed them."""

from __future__ import annotations

from pagedattn import LLM, SamplingParams
from pagedattn.core.kv_cache_utils import hash_request_tokens
from tests.model.tiny import make_tiny_llama

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def test_store_saves_accepted_blocks_only(tmp_path):
    path = make_tiny_llama(tmp_path)
    common = {"dtype": "float32", "num_blocks": 128, "block_size": 4}
    url = f"file://{tmp_path}/kv"
    spec = LLM(path, **common, kv_store=url, speculative_method="ngram", ngram_min=1)
    connector = spec.engine.runner.kv_connector
    saved: list[bytes] = []
    save_blocks = connector.save_blocks

    def recording_save(kv_caches, block_ids, block_hashes):
        saved.extend(block_hashes)
        return save_blocks(kv_caches, block_ids, block_hashes)

    connector.save_blocks = recording_save
    output = spec.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    spec.engine.close()
    stats = spec.get_stats().spec_decode
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some drafts were rejected
    chain = hash_request_tokens(4, PROMPT + output, "pagedattn")
    assert set(saved) <= set(chain)
    # Every full block is saved, also those that accepted drafts completed (their hashes exist
    # only after the step that computed them); the final step's may be left out.
    num_computed = len(PROMPT) + len(output) - 1
    assert set(chain[: num_computed // 4 - 2]) <= set(saved), (len(set(saved)), len(chain))
    # A fresh engine loads those blocks and continues as a cold engine does.
    longer = PROMPT + output[:30]
    cold = LLM(path, **common).generate([longer], GREEDY)[0].outputs[0].token_ids
    warm = LLM(path, **common, kv_store=url)
    assert warm.generate([longer], GREEDY)[0].outputs[0].token_ids == cold
    assert warm.get_stats().kv_store.num_loaded_blocks > len(PROMPT) // 4
    warm.engine.close()
