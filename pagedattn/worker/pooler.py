"""Pooler: an embedding from a pooling sequence's final hidden states, across prefill chunks.

`SamplingParams.pooling` "last" takes the hidden state of the prompt's last token; "mean"
averages every prompt token's (the caller keeps such a request off the prefix cache, since
cached positions have no hidden state here). The vectors are the model's output after its final
norm, not normalised (the API normalises them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Pooler:
    """Pools the hidden states of the sequences that ask, one prefill chunk at a time."""

    def __init__(self) -> None:
        # Mean pooling: sequence id -> (sum of the rows so far, rows summed, next position).
        self._sums: dict[str, tuple[torch.Tensor, int, int]] = {}

    def release(self, req_id: str) -> None:
        self._sums.pop(req_id, None)

    def __call__(self, scheduled: Sequence, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Sequence id -> pooled vector, for pooling sequences whose prompt ended this step."""
        out: dict[str, list[float]] = {}
        offset = 0
        for s in scheduled:
            num_tokens = len(s.token_ids)
            params = s.sampling_params
            mode = None if params is None else params.pooling
            num_prompt = len(s.prompt_token_ids)
            end = min(s.start_pos + num_tokens, num_prompt)
            if mode is not None and end > s.start_pos:
                rows = hidden[offset : offset + end - s.start_pos].float()  # [rows, hidden]
                if mode == "last":
                    if end == num_prompt:
                        out[s.req_id] = rows[-1].tolist()
                else:
                    total, count, next_pos = self._sums.get(s.req_id, (None, 0, 0))
                    # NOTE: a recompute after preemption repeats positions already summed.
                    fresh = rows[max(0, next_pos - s.start_pos) :]
                    if len(fresh):
                        part = fresh.sum(0)
                        total = part if total is None else total + part
                        count += len(fresh)
                    self._sums[s.req_id] = (total, count, max(end, next_pos))
                    if end == num_prompt and total is not None:
                        out[s.req_id] = (total / count).tolist()
                        self.release(s.req_id)
            offset += num_tokens
        return out
