"""Rejection sampling keeps plain sampling's distribution (a statistical test), and greedy
verification accepts exactly the drafts that equal the argmax."""

from __future__ import annotations

import torch

from pagedattn.sampling_params import SamplingParams
from pagedattn.worker.rejection_sampler import target_probs, verify, verify_greedy

NUM_SAMPLES = 12000
# |empirical - exact| in total variation: the noise of 12000 samples over 6 tokens is ~0.01.
TV_BOUND = 0.035


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_greedy_accepts_the_matching_prefix():
    logits = torch.tensor([[0, 5.0, 1], [3.0, 0, 0], [0, 0, 2.0], [1.0, 0, 0]])
    assert verify_greedy(logits, [1, 0, 1]) == ([1, 0], 2)
    assert verify_greedy(logits, [1, 0, 2]) == ([1, 0, 2], 0)  # all accepted: the bonus token
    assert verify_greedy(logits, [2, 0, 2]) == ([], 1)


def test_rejection_sampling_matches_plain_sampling():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    probs = target_probs(logits, params)
    # One likely and one unlikely draft token, so both acceptance and rejection happen often.
    draft = [int(probs[0].argmax()), int(probs[1].argmin(dim=-1))]
    first = torch.zeros(6)
    second = torch.zeros(6)
    num_accepted = 0
    for _ in range(NUM_SAMPLES):
        accepted, token = verify(logits, draft, params, gen)
        emitted = [*accepted, token]
        first[emitted[0]] += 1
        if len(emitted) > 1:  # the first was the draft: row 1 scored what follows it
            second[emitted[1]] += 1
        num_accepted += len(accepted)
    assert 0 < num_accepted < 2 * NUM_SAMPLES
    assert _tv(first, probs[0]) < TV_BOUND
    assert _tv(second, probs[1]) < TV_BOUND
    assert first[int(probs[0].argmin())] == 0  # top_k=5 removed the least likely token
    # The bound can fail: resampling from p itself on rejection would give the draft token
    # p + (1 - p) p, a total-variation error far above the bound.
    p = float(probs[0, draft[0]])
    assert (1 - p) * p > 2 * TV_BOUND
