"""Sampler: greedy, truncation filters, distribution, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn.sampling_params import SamplingParams
from pagedattn.worker.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)
from pagedattn.worker.sampling_metadata import build_sampling_metadata, make_generator

VOCAB_SIZE = 64
EOS = 3


def _meta(params, outputs=None, prompts=None, generators=None, vocab_size=VOCAB_SIZE):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return build_sampling_metadata(
        params, outputs, prompts, generators, vocab_size, eos_token_ids=[EOS]
    )


def _logits(num_reqs: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_reqs, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_is_argmax_and_skips_everything() -> None:
    logits = _logits(8)
    before = logits.clone()
    meta = _meta([SamplingParams(temperature=0.0)] * 8)
    assert meta.all_greedy and meta.temperature is None and meta.no_penalties
    assert meta.min_tokens_mask is None and meta.num_logprobs is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_greedy_on_bf16_logits_is_their_argmax_and_still_applies_bias() -> None:
    # A bf16 model's logits: plain greedy rows take their argmax as they are; a logit_bias (or
    # a penalty, grammar, min_tokens) still goes through the float32 path first.
    logits = _logits(8).to(torch.bfloat16)
    plain = Sampler()(logits, _meta([SamplingParams(temperature=0.0)] * 8))
    assert torch.equal(plain.sampled_token_ids, logits.float().argmax(-1))
    low = int(logits[0].float().argmin())
    biased = SamplingParams(temperature=0.0, logit_bias={low: 100.0})
    out = Sampler()(logits, _meta([biased] + [SamplingParams(temperature=0.0)] * 7))
    assert out.sampled_token_ids[0].item() == low
    assert torch.equal(out.sampled_token_ids[1:], plain.sampled_token_ids[1:])


def test_greedy_ties_take_lowest_id() -> None:
    logits = torch.zeros(1, VOCAB_SIZE)
    logits[0, [7, 5, 9]] = 2.0
    out = Sampler()(logits, _meta([SamplingParams(temperature=0.0)]))
    assert out.sampled_token_ids.tolist() == [5]


@pytest.mark.parametrize("method", ["exponential", "inverse_cdf"])
@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_equal_greedy(params: SamplingParams, method: str) -> None:
    logits = _logits(16, seed=1)
    sampler = Sampler(torch.Generator().manual_seed(0), method=method)
    before = logits.clone()
    for _ in range(5):
        out = sampler(logits, _meta([params] * 16))
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = _logits(6, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)] * 3
    meta = _meta(params)
    assert not meta.all_greedy and not meta.all_random
    sampled = Sampler(torch.Generator().manual_seed(0))(logits, meta).sampled_token_ids
    assert torch.equal(sampled[0::2], logits[0::2].argmax(-1))


METHODS = ["exponential", "inverse_cdf"]


@pytest.mark.parametrize("method", METHODS)
def test_min_p_masks_unlikely_tokens(method: str) -> None:
    probs = torch.tensor([[0.4, 0.3, 0.19, 0.11]])
    masked = apply_min_p(probs.log(), torch.tensor([0.5]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False]]
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 2000
    logits = probs.log().expand(2000, -1).contiguous()
    sampler = Sampler(torch.Generator().manual_seed(0), method=method)
    sampled = sampler(logits, _meta(params, vocab_size=4))
    counts = torch.bincount(sampled.sampled_token_ids, minlength=4).tolist()
    assert counts[2] == counts[3] == 0 and counts[0] > counts[1] > 0


def test_top_k_per_row_and_off() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    masked = apply_top_k(logits.clone(), torch.tensor([2, 4]))
    assert torch.isfinite(masked).tolist() == [[False, True, True, False], [True] * 4]


def _reference_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's sort-based top-p."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    mask = probs_sum <= 1 - top_p.unsqueeze(1)
    mask[:, -1] = False
    logits_sort.masked_fill_(mask, float("-inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def test_top_p_hand_case() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept_08 = torch.isfinite(apply_top_p(logits.clone(), torch.tensor([0.79])))
    kept_09 = torch.isfinite(apply_top_p(logits.clone(), torch.tensor([0.9])))
    assert kept_08.tolist() == [[True, True, False, False]]
    assert kept_09.tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0])
def test_top_p_matches_sort_reference(scale: float) -> None:
    # scale 0.1: a flat distribution forces the candidate set to widen up to the whole vocab.
    logits = torch.randn(12, 3000, generator=torch.Generator().manual_seed(3)) * scale
    top_p = torch.tensor([0.05, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 1.0, 0.6, 0.8, 0.2, 1.0])
    got = torch.isfinite(apply_top_p(logits.clone(), top_p))
    want = torch.isfinite(_reference_top_p(logits.clone(), top_p))
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_temperature_distribution(method: str) -> None:
    num_samples = 20000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    params = [SamplingParams(temperature=temperature)] * num_samples
    batch = logits.expand(num_samples, -1).contiguous()
    sampler = Sampler(torch.Generator().manual_seed(1234), method=method)
    sampled = sampler(batch, _meta(params, vocab_size=5)).sampled_token_ids
    observed = torch.bincount(sampled, minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1) * num_samples
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001. The wrong temperature (1.0) gives >> 100.
    assert chi2 < 18.47
    wrong = torch.softmax(logits.double(), dim=-1) * num_samples
    assert float(((observed - wrong) ** 2 / wrong).sum()) > 100


@pytest.mark.parametrize("method", METHODS)
def test_distribution_across_cdf_blocks(method: str) -> None:
    # Mass at block edges of the two-level CDF (1024 tokens per block), with a padded last block.
    num_reqs, num_steps, vocab_size = 2000, 5, 2500
    token_ids = torch.tensor([0, 1023, 1024, 2047, 2048, 2499])
    probs = torch.tensor([0.1, 0.25, 0.05, 0.3, 0.2, 0.1])
    logits = torch.full((vocab_size,), float("-inf"))
    logits[token_ids] = probs.log()
    batch = logits.expand(num_reqs, -1).contiguous()
    meta = _meta([SamplingParams(temperature=1.0)] * num_reqs, vocab_size=vocab_size)
    sampler = Sampler(torch.Generator().manual_seed(7), method=method)
    sampled = torch.cat([sampler(batch, meta).sampled_token_ids for _ in range(num_steps)])
    counts = torch.bincount(sampled, minlength=vocab_size).double()
    num_samples = num_reqs * num_steps
    assert counts.sum() == counts[token_ids].sum()
    expected = probs.double() * num_samples
    chi2 = float(((counts[token_ids] - expected) ** 2 / expected).sum())
    assert chi2 < 20.52  # 5 degrees of freedom, P(chi2 > 20.52) = 0.001


def _run_steps(params_list, seeded_row, num_steps, method, vocab_size=VOCAB_SIZE):
    """Sample `num_steps` steps; all rows see the same logits stream; return seeded row's tokens."""
    generators = [make_generator(p.seed) if p.seed is not None else None for p in params_list]
    sampler = Sampler(torch.Generator().manual_seed(99), method=method)
    tokens = []
    for step in range(num_steps):
        logits = _logits(1, vocab_size, seed=100 + step).expand(len(params_list), -1).contiguous()
        meta = _meta(params_list, generators=generators, vocab_size=vocab_size)
        tokens.append(int(sampler(logits, meta).sampled_token_ids[seeded_row]))
    return tokens


@pytest.mark.parametrize("method", METHODS)
def test_seeded_request_independent_of_batch(method: str) -> None:
    seeded = SamplingParams(temperature=1.5, top_p=0.95, seed=42)
    alone = _run_steps([seeded], 0, 12, method)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    other_seed = SamplingParams(temperature=1.5, top_p=0.95, seed=7)
    in_batch = _run_steps([others[0], other_seed, seeded, others[1]], 2, 12, method)
    assert alone == in_batch
    assert _run_steps([other_seed], 0, 12, method) != alone


def test_unknown_method_rejected() -> None:
    with pytest.raises(ValueError, match="method='gumbel' is invalid"):
        Sampler(method="gumbel")


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0, 3.0]])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    meta = _meta([params], outputs=[[0, 0, 1]], prompts=[[2, 4]], vocab_size=6)
    got = apply_penalties(logits, meta)
    # token 0: output x2 -> 2/2 - 0.5*2 - 0.25 = -0.25; token 1: output x1 -> -1*2 - 0.5 - 0.25
    # token 2: prompt -> 0.5/2; token 4: prompt -> -2*2; tokens 3, 5 unseen.
    want = torch.tensor([[-0.25, -2.75, 0.25, 1.0, -4.0, 3.0]])
    torch.testing.assert_close(got, want)
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [5]
    # Presence/frequency ignore the prompt: the prompt-only token 5 keeps its logit.
    meta2 = _meta(
        [SamplingParams(temperature=0.0, presence_penalty=2.0)], prompts=[[5]], vocab_size=6
    )
    assert meta2.prompt_token_ids is None
    torch.testing.assert_close(apply_penalties(logits, meta2), logits)


def _reference_penalties(logits, prompts, outputs, rep, freq, presence):
    """vLLM's dense formulation, one row at a time."""
    out = logits.clone()
    for i in range(out.shape[0]):
        counts = torch.bincount(torch.tensor(outputs[i], dtype=torch.int64), minlength=VOCAB_SIZE)
        seen = counts > 0
        seen[torch.tensor(prompts[i], dtype=torch.int64)] = True
        row = out[i]
        penalty = torch.where(seen, torch.tensor(rep[i]), torch.tensor(1.0))
        row = torch.where(row > 0, row / penalty, row * penalty)
        out[i] = row - freq[i] * counts - presence[i] * (counts > 0)
    return out


def test_penalties_match_dense_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    num_reqs = 6
    logits = _logits(num_reqs, seed=12)
    rand = lambda lo, hi: float(torch.empty(1).uniform_(lo, hi, generator=gen))  # noqa: E731
    rep = [rand(0.5, 2.0) for _ in range(num_reqs)]
    rep[0] = 1.0
    freq = [rand(-2.0, 2.0) for _ in range(num_reqs)]
    presence = [rand(-2.0, 2.0) for _ in range(num_reqs)]
    lens = torch.randint(0, 30, (2, num_reqs), generator=gen).tolist()
    prompts = [torch.randint(0, 20, (n,), generator=gen).tolist() for n in lens[0]]
    outputs = [torch.randint(10, 30, (n,), generator=gen).tolist() for n in lens[1]]
    params = [
        SamplingParams(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for r, f, p in zip(rep, freq, presence, strict=True)
    ]
    got = apply_penalties(logits, _meta(params, outputs=outputs, prompts=prompts))
    want = _reference_penalties(logits, prompts, outputs, rep, freq, presence)
    torch.testing.assert_close(got, want)


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    assert Sampler()(logits, _meta(params, outputs=[[]], vocab_size=4)).sampled_token_ids == 0
    assert Sampler()(logits, _meta(params, outputs=[[0]], vocab_size=4)).sampled_token_ids == 1


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(3, VOCAB_SIZE)
    logits[:, EOS] = 10.0
    logits[:, 11] = 9.0
    logits[:, 20] = 8.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[11]),
        SamplingParams(temperature=0.0, min_tokens=2),
        SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
    ]
    short = build_sampling_metadata(params, [[1]] * 3, [[]] * 3, None, VOCAB_SIZE, [EOS])
    assert Sampler()(logits, short).sampled_token_ids.tolist() == [20, 11, EOS]
    done = build_sampling_metadata(params, [[1, 2]] * 3, [[]] * 3, None, VOCAB_SIZE, [EOS])
    assert done.min_tokens_mask is None
    assert Sampler()(logits, done).sampled_token_ids.tolist() == [EOS] * 3


def test_logprobs_are_raw_log_softmax_with_true_top_k() -> None:
    logits = _logits(4, seed=5)
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.8, logprobs=0, seed=3),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, logprobs=2),
    ]
    meta = _meta(params, outputs=[[1, 2]] * 4, prompts=[[3]] * 4)
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for row, k in [(0, 5), (1, 0), (3, 2)]:
        entry = out.logprobs[row]
        token = int(out.sampled_token_ids[row])
        assert math.isclose(entry.sampled_logprob, float(raw[row, token]), rel_tol=1e-5)
        assert entry.sampled_rank == int((raw[row] >= raw[row, token]).sum())
        top = raw[row].topk(k)
        assert entry.top_token_ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(entry.top_logprobs), top.values)
        assert len(entry.top_token_ids) == k


def test_logit_bias_moves_greedy_choice_and_leaves_caller_logits() -> None:
    logits = _logits(3)
    before = logits.clone()
    target = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmax()): -100.0}),
    ]
    out = Sampler()(logits, _meta(params))
    assert torch.equal(logits, before)
    assert int(out.sampled_token_ids[0]) == target
    assert int(out.sampled_token_ids[1]) == int(logits[1].argmax())
    assert int(out.sampled_token_ids[2]) != int(logits[2].argmax())
    assert out.terminated_rows == []


def test_logit_bias_ignores_ids_outside_the_logits() -> None:
    meta = _meta([SamplingParams(logit_bias={VOCAB_SIZE + 5: 1.0, 2: 1.0})])
    rows, ids, biases = meta.logit_bias
    assert ids.tolist() == [2] and rows.tolist() == [0] and biases.tolist() == [1.0]


class _OnlyTokenMatcher:
    """A stand-in grammar: only `token` is allowed; terminates after `length` tokens."""

    def __init__(self, token: int, length: int) -> None:
        self.token, self.length, self.accepted = token, length, []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id == self.token

    @property
    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_bitmask_applies_to_constrained_rows_only_and_reports_terminated_rows() -> None:
    pytest.importorskip("xgrammar")
    logits = _logits(3)
    first, last = _OnlyTokenMatcher(token=37, length=1), _OnlyTokenMatcher(token=5, length=2)
    params = [SamplingParams(temperature=1.0, logit_bias={37: -100.0}),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]  # fmt: skip
    meta = build_sampling_metadata(
        params, [[], [], []], [[], [], []], None, VOCAB_SIZE, matchers=[first, None, last]
    )
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist()[0] == 37  # the mask beats a -100 bias
    assert out.sampled_token_ids.tolist()[1] == int(logits[1].argmax())
    assert out.sampled_token_ids.tolist()[2] == 5
    assert out.terminated_rows == [0]
    assert first.accepted == [37] and last.accepted == [5]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_grammar_that_can_only_end_ends_despite_min_tokens(temperature: float) -> None:
    pytest.importorskip("xgrammar")
    # Row 0's grammar allows only EOS (its match is complete); row 1 is free with min_tokens.
    logits = _logits(2)
    ended, free = _OnlyTokenMatcher(token=EOS, length=1), None
    params = [SamplingParams(temperature=temperature, seed=1, min_tokens=8)] * 2
    meta = build_sampling_metadata(
        params, [[1, 2, 4]] * 2, [[]] * 2, None, VOCAB_SIZE, [EOS], matchers=[ended, free]
    )
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta)
    sampled = out.sampled_token_ids.tolist()
    assert sampled[0] == EOS and sampled[1] != EOS
    assert out.terminated_rows == [0] and ended.accepted == [EOS]


def test_a_constrained_row_with_no_token_left_fails_before_any_matcher_advances() -> None:
    pytest.importorskip("xgrammar")
    from pagedattn.worker.sampler import StructuredOutputError

    logits = _logits(2)
    logits[1, 7] = float("-inf")  # the only token row 1's grammar allows
    first, second = _OnlyTokenMatcher(token=5, length=2), _OnlyTokenMatcher(token=7, length=2)
    meta = build_sampling_metadata(
        [SamplingParams(temperature=0.0)] * 2, [[]] * 2, [[]] * 2, None, VOCAB_SIZE,
        matchers=[first, second],
    )  # fmt: skip
    with pytest.raises(StructuredOutputError, match="row 1"):
        Sampler()(logits, meta)
    assert first.accepted == [] and second.accepted == []
