"""build_input_batch: flattened ids, positions, slots per KV cache group, and the sampled rows."""

from __future__ import annotations

import torch

from pagedattn.core.scheduler_output import ScheduledRequest
from pagedattn.worker import input_batch
from pagedattn.worker.input_batch import build_input_batch


def _sched(req_id, token_ids, start, tables, needs_sample) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        token_ids=token_ids,
        start_pos=start,
        block_ids=tables,
        needs_sample=needs_sample,
        sampling_params=None,
        seed=None,
        prompt_token_ids=[],
        output_token_ids=[],
    )


def _mixed_batch() -> list[ScheduledRequest]:
    return [
        _sched("decode", [7], 9, ([3, 8, 5], [1, 2, 6]), True),  # position 9: block 5, offset 1
        _sched("chunk", [1, 2, 3, 4, 5], 0, ([4, 9], [10, 11]), False),  # a partial prefill
        _sched("last", [6, 6], 6, ([12, 13], [14, 15]), True),  # positions 6, 7
    ]


def test_a_decode_a_prefill_chunk_and_a_last_chunk_in_one_batch(monkeypatch):
    # Spans longer than the short-span cut keep one attention row each.
    monkeypatch.setattr(input_batch, "SHORT_SPAN_TOKENS", 1)
    block_size = 4
    scheduled = _mixed_batch()
    batch = build_input_batch(scheduled, block_size, num_groups=2, device="cpu")
    assert batch.input_ids.tolist() == [7, 1, 2, 3, 4, 5, 6, 6]
    assert batch.positions.tolist() == [9, 0, 1, 2, 3, 4, 6, 7]
    full, other = batch.attn_metadata
    assert full.slot_mapping.tolist() == [21, 16, 17, 18, 19, 36, 54, 55]
    assert other.slot_mapping.tolist() == [25, 40, 41, 42, 43, 44, 62, 63]
    assert full.query_start_loc_cpu == [0, 1, 6, 8] and full.seq_lens_cpu == [10, 5, 8]
    assert full.block_tables.tolist() == [[3, 8, 5], [4, 9, 0], [12, 13, 0]]
    assert (full.max_query_len, full.max_seq_len, full.num_actual_tokens) == (5, 10, 8)
    # Only the rows that end their known tokens are sampled: their last token's hidden state.
    assert batch.sampled == [0, 2]
    assert batch.logits_indices.tolist() == [0, 7]
    assert batch.input_ids.dtype == torch.int64 and full.slot_mapping.dtype == torch.int64


def test_short_spans_attend_one_query_per_position_so_the_step_is_a_decode_step():
    batch = build_input_batch(_mixed_batch(), block_size=4, num_groups=2, device="cpu")
    full, other = batch.attn_metadata
    # Position p of a span sees the cache up to itself, on its sequence's block table.
    assert full.seq_lens_cpu == [10, 1, 2, 3, 4, 5, 7, 8]
    assert full.query_start_loc_cpu == list(range(9))
    assert full.block_tables.tolist() == [[3, 8, 5]] + [[4, 9, 0]] * 5 + [[12, 13, 0]] * 2
    assert other.block_tables.tolist()[1] == [10, 11, 0]
    assert full.is_pure_decode and not full.verifies_drafts
    # Tokens, slots and sampled rows are those of the unsplit step.
    assert batch.positions.tolist() == [9, 0, 1, 2, 3, 4, 6, 7]
    assert full.slot_mapping.tolist() == [21, 16, 17, 18, 19, 36, 54, 55]
    assert batch.sampled == [0, 2] and batch.logits_indices.tolist() == [0, 7]
    # One span past the cut keeps the step as it was.
    long_chunk = _sched("long", list(range(17)), 0, ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]), False)
    batch = build_input_batch([*_mixed_batch(), long_chunk], 4, num_groups=2, device="cpu")
    assert batch.attn_metadata[0].seq_lens_cpu == [10, 5, 8, 17]
