"""Verify draft tokens against the target's logits: exact greedy match or rejection sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedattn.sampling_params import SAMPLING_EPS, SamplingParams
from pagedattn.worker.sampler import apply_min_p, apply_top_k, apply_top_p


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from at each row: temperature, min_p, top_k, top_p.

    logits: [num_rows, vocab_size] (left unmodified); returns float32 probabilities.
    """
    num_rows = logits.shape[0]
    logits = logits.float() / params.temperature  # a new tensor: the filters work in place
    if params.min_p > 0.0:
        logits = apply_min_p(logits, torch.full((num_rows,), params.min_p))
    if params.top_k is not None and 0 < params.top_k < logits.shape[1]:
        logits = apply_top_k(logits, torch.full((num_rows,), params.top_k, dtype=torch.int64))
    if params.top_p < 1.0:
        logits = apply_top_p(logits, torch.full((num_rows,), params.top_p))
    return logits.softmax(dim=-1)


def verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> tuple[list[int], int]:
    """Accept the drafts while each is the target's argmax; then the target's own token.

    logits: [len(draft) + 1, vocab_size]. Returns (accepted drafts, next token).
    """
    target = logits.argmax(dim=-1).tolist()  # NOTE: first index on ties, as the sampler
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == target[num_accepted]:
        num_accepted += 1
    return list(draft[:num_accepted]), target[num_accepted]


def verify_random(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) of a point-mass proposal.

    Both proposers here draft deterministically (q = 1 at the draft token), so draft d at row
    i is accepted with probability min(1, p(d) / q(d)) = p(d); on rejection the token comes from
    max(0, p - q) renormalised, which is p with d removed. Every emitted token is then
    distributed exactly as plain sampling from p; after K acceptances one more is drawn from
    the last row.
    """
    probs = target_probs(logits, params)  # [K + 1, vocab_size]
    uniforms = torch.rand(len(draft), generator=generator).tolist()
    for i, token in enumerate(draft):
        p = float(probs[i, token])
        if uniforms[i] < p:
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # NOTE: p(d) rounded below 1 with no other mass
            continue
        return list(draft[:i]), int(torch.multinomial(residual, 1, generator=generator))
    return list(draft), int(torch.multinomial(probs[len(draft)], 1, generator=generator))


def verify(
    logits: torch.Tensor,
    draft: Sequence[int],
    params: SamplingParams | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """(accepted drafts, next token) of one sequence; logits [len(draft) + 1, vocab_size]."""
    if params is None or params.temperature < SAMPLING_EPS:
        return verify_greedy(logits, draft)
    return verify_random(logits, draft, params, generator)
