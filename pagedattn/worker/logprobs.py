"""Logprobs of sampled tokens and of the most likely tokens, from the model's raw logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class TokenLogprobs(NamedTuple):
    """One request's logprobs for one sampled token."""

    sampled_logprob: float
    # 1-based; the number of tokens whose logprob is >= the sampled token's (vLLM's rank).
    sampled_rank: int
    # The `logprobs` most likely token ids, most likely first, and their logprobs.
    top_token_ids: list[int]
    top_logprobs: list[float]


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Raw model logprobs: log_softmax of the logits before penalties and temperature."""
    return torch.log_softmax(logits.float(), dim=-1)  # [num_reqs, vocab_size]


def gather_logprobs(
    logprobs: torch.Tensor,
    sampled_token_ids: torch.Tensor,
    num_logprobs: Sequence[int | None],
    max_num_logprobs: int,
) -> list[TokenLogprobs | None]:
    """Per row: None, or the sampled token's logprob and rank plus the top-`k` ids and logprobs."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if len(rows) < len(num_logprobs):
        index = torch.tensor(rows, dtype=torch.int64, device=logprobs.device)
        logprobs = logprobs.index_select(0, index)  # [num_rows, vocab_size]
        sampled_token_ids = sampled_token_ids.index_select(0, index)
    sampled = logprobs.gather(1, sampled_token_ids.view(-1, 1).long())  # [num_rows, 1]
    ranks = (logprobs >= sampled).sum(dim=-1)  # [num_rows]
    if max_num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(max_num_logprobs, dim=-1)  # [num_rows, k]
        top_logprobs_list, top_ids_list = top_logprobs.tolist(), top_ids.tolist()
    else:
        top_logprobs_list = top_ids_list = [[] for _ in rows]
    sampled_list, ranks_list = sampled.view(-1).tolist(), ranks.tolist()

    out: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for j, row in enumerate(rows):
        k = num_logprobs[row]
        out[row] = TokenLogprobs(
            sampled_logprob=sampled_list[j],
            sampled_rank=ranks_list[j],
            top_token_ids=top_ids_list[j][:k],
            top_logprobs=top_logprobs_list[j][:k],
        )
    return out
