"""Sampler: penalties, temperature, min-p/top-k/top-p and batched sampling of the next tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedattn.cpu import extension as cpu_ext
from pagedattn.sampling_params import SAMPLING_EPS
from pagedattn.worker.logprobs import TokenLogprobs, compute_logprobs, gather_logprobs
from pagedattn.worker.sampling_metadata import SamplingMetadata

# Top-p first looks for its nucleus among this many most likely tokens, then widens by
# TOP_P_WIDEN_FACTOR until the candidates hold mass >= p (a full sort is the last resort).
TOP_P_INITIAL_CANDIDATES = 128
TOP_P_WIDEN_FACTOR = 8
# Block size of the two-level cumulative distribution used by inverse-CDF sampling.
CDF_BLOCK_SIZE = 1024


class SamplerOutput(NamedTuple):
    """The tokens sampled in one step, and their logprobs for the requests that asked."""

    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: list[TokenLogprobs | None] | None  # per request; None when no request asked
    # Rows whose grammar completed with this token: those requests stop (finish_reason "stop").
    terminated_rows: list[int] = []


class StructuredOutputError(RuntimeError):
    """A sampled token was not allowed by the request's grammar (a bug, or an all-masked row)."""


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (first index on ties); one compiled pass on CPU."""
    compiled_dtype = logits.dtype in (torch.float32, torch.bfloat16)
    if logits.device.type == "cpu" and compiled_dtype and logits.is_contiguous():
        ext = cpu_ext.step_ops()
        if ext is not None and logits.dim() == 2 and logits.shape[1] > 0:
            return ext.argmax_last_dim(logits)
    return logits.argmax(dim=-1)


def _greedy_on_raw_logits(metadata: SamplingMetadata) -> bool:
    """Every row greedy, and no penalty, bias, grammar or min_tokens to apply first."""
    return (
        metadata.all_greedy
        and metadata.no_penalties
        and metadata.logit_bias is None
        and metadata.matchers is None
        and metadata.min_tokens_mask is None
    )


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Forbid stop tokens (and EOS) for requests that have not yet produced min_tokens tokens.

    NOTE: after the grammar mask. The grammar wins over min_tokens: a constrained row whose
    grammar allows nothing but a stop token (the match is complete) keeps its stop tokens, so
    the request ends shorter than min_tokens instead of failing.
    """
    if metadata.min_tokens_mask is None:
        return logits
    rows, token_ids = metadata.min_tokens_mask
    saved = logits[rows, token_ids] if metadata.matchers is not None else None
    logits.index_put_((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))
    if saved is not None:
        only_stop = torch.isneginf(logits).all(dim=-1)  # [num_reqs]
        revive = only_stop[rows]
        if bool(revive.any()):
            logits.index_put_((rows[revive], token_ids[revive]), saved[revive])
    return logits


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add each request's logit_bias to its row (in place)."""
    if metadata.logit_bias is not None:
        rows, token_ids, biases = metadata.logit_bias
        logits.index_put_((rows, token_ids), biases, accumulate=True)
    return logits


def apply_grammar_bitmask(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Forbid (-inf) every token the grammar of a constrained row does not allow (in place)."""
    if metadata.matchers is None:
        return logits
    from pagedattn.structured_output.matcher import allocate_bitmask, apply_bitmask

    rows = [i for i, m in enumerate(metadata.matchers) if m is not None]
    bitmask = allocate_bitmask(logits.shape[0], logits.shape[1])  # [num_reqs, ceil(vocab / 32)]
    for row in rows:
        metadata.matchers[row].fill_bitmask(bitmask, row)
    apply_bitmask(logits, bitmask, rows)
    return logits


def check_constrained_rows(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Raise StructuredOutputError for a constrained row with no token left to sample.

    NOTE: before any matcher advances, so a failed batch can be retried row by row.
    """
    if metadata.matchers is None:
        return
    rows = [i for i, m in enumerate(metadata.matchers) if m is not None]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    dead = torch.isneginf(logits.index_select(0, index)).all(dim=-1)  # [num_constrained]
    for j in dead.nonzero().view(-1).tolist():
        raise StructuredOutputError(
            f"row {rows[j]}: the request's grammar and its logit_bias/penalties leave no token "
            "that may come next"
        )


def advance_matchers(sampled: torch.Tensor, metadata: SamplingMetadata) -> list[int]:
    """Feed each constrained row its sampled token; the rows whose grammar has terminated."""
    if metadata.matchers is None:
        return []
    token_ids = sampled.tolist()
    terminated = []
    for row, matcher in enumerate(metadata.matchers):
        if matcher is None:
            continue
        if not matcher.accept_token(token_ids[row]):
            raise StructuredOutputError(
                f"row {row}: token {token_ids[row]} is not allowed by the request's grammar"
            )
        if matcher.is_terminated:
            terminated.append(row)
    return terminated


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM penalties: repetition over prompt + output tokens, presence/frequency over output.

    Returns a new tensor. Only the seen tokens are touched (gather/scatter), never the whole vocab.
    """
    if metadata.no_penalties:
        return logits
    num_reqs, vocab_size = logits.shape
    # NOTE: token lists are padded with vocab_size; the extra column absorbs the padding.
    padded = logits.new_empty(num_reqs, vocab_size + 1)  # [num_reqs, vocab_size + 1]
    padded[:, :vocab_size] = logits
    output_ids = metadata.output_token_ids  # [num_reqs, max_output_len]
    if metadata.prompt_token_ids is not None:
        seen_ids = torch.cat([metadata.prompt_token_ids, output_ids], dim=1)
        seen = padded.gather(1, seen_ids)  # [num_reqs, max_prompt_len + max_output_len]
        penalty = metadata.repetition_penalties.unsqueeze(1)
        # Repeated ids write the same value, so the scatter is deterministic.
        padded.scatter_(1, seen_ids, torch.where(seen > 0, seen / penalty, seen * penalty))
    if output_ids.shape[1] > 0:
        # Frequency: once per occurrence. Presence: once per distinct token (first in sort order).
        sorted_ids = output_ids.sort(dim=1).values
        is_first = torch.ones_like(sorted_ids, dtype=torch.bool)
        is_first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
        delta = metadata.frequency_penalties.unsqueeze(1) + torch.where(
            is_first, metadata.presence_penalties.unsqueeze(1), 0.0
        )  # [num_reqs, max_output_len]
        padded.scatter_add_(1, sorted_ids, -delta)
    return padded[:, :vocab_size]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    # NOTE: p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); no softmax needed.
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)  # [num_reqs, 1]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the top_k most likely tokens of each row (ties with the k-th are kept)."""
    max_top_k = int(top_k.max())
    top_values = logits.topk(max_top_k, dim=-1).values  # [num_reqs, max_top_k]
    threshold = top_values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    threshold.masked_fill_((top_k >= logits.shape[1]).unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p."""
    vocab_size = logits.shape[1]
    probs = logits.softmax(dim=-1)  # [num_reqs, vocab_size]
    threshold = torch.zeros(logits.shape[0], 1, dtype=probs.dtype, device=probs.device)
    pending = top_p < 1.0
    num_candidates = min(TOP_P_INITIAL_CANDIDATES, vocab_size)
    while bool(pending.any()):
        rows = pending.nonzero().squeeze(1)
        row_probs, row_top_p = probs[rows], top_p[rows]  # [num_rows, vocab_size], [num_rows]
        if num_candidates == vocab_size:
            top_probs = row_probs.sort(dim=-1, descending=True).values
        else:
            top_probs = row_probs.topk(num_candidates, dim=-1).values  # [num_rows, num_candidates]
        covered = (top_probs.sum(dim=-1) >= row_top_p) | (num_candidates == vocab_size)
        # A token is kept while the mass strictly above it is still short of top_p.
        mass_above = top_probs.cumsum(dim=-1) - top_probs
        num_kept = (mass_above < row_top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
        row_threshold = top_probs.gather(1, (num_kept - 1).unsqueeze(1))  # [num_rows, 1]
        threshold[rows[covered]] = row_threshold[covered]
        pending[rows[covered]] = False
        num_candidates = min(num_candidates * TOP_P_WIDEN_FACTOR, vocab_size)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def _draw_uniform(
    shape: tuple[int, ...],
    num_reqs: int,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """[num_reqs, *shape] uniforms in [0, 1); a seeded row draws only from its own generator."""
    noise = torch.empty(num_reqs, *shape, device=device)
    if len(generators) < num_reqs:
        torch.rand(noise.shape, generator=default_generator, device=device, out=noise)
    # NOTE: a seeded request draws the same count per step whatever the batch holds, so its
    # tokens depend only on its seed and its own logits.
    for row, generator in generators.items():
        torch.rand(shape, generator=generator, device=device, out=noise[row])
    return noise


def exponential_race_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """vLLM's sampler: argmax(probs / E), E ~ Exponential(1) per token, is a sample from probs."""
    num_reqs, vocab_size = probs.shape
    noise = _draw_uniform((vocab_size,), num_reqs, generators, default_generator, probs.device)
    # NOTE: E = -log(U) is ~5x faster on CPU than Tensor.exponential_; U in [0, 1) gives E > 0.
    noise.log_().neg_()
    return probs.div_(noise).argmax(dim=-1)


def inverse_cdf_sample(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """One uniform per request looked up in the cumulative distribution (cheapest on CPU)."""
    num_reqs, vocab_size = probs.shape
    uniform = _draw_uniform((1,), num_reqs, generators, default_generator, probs.device)
    # NOTE: a float64 cumsum over the whole vocab is slow on CPU, so the lookup has two levels:
    # the cumulative mass of CDF_BLOCK_SIZE-token blocks, then the cumsum inside one block.
    block_size = min(CDF_BLOCK_SIZE, vocab_size)
    num_blocks = -(-vocab_size // block_size)
    padding = num_blocks * block_size - vocab_size
    if padding:
        probs = torch.nn.functional.pad(probs, (0, padding))
    blocks = probs.view(num_reqs, num_blocks, block_size)
    block_cdf = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [num_reqs, num_blocks]
    # A float32 U <= 1 - 2**-24 keeps the target strictly below the total mass.
    target = uniform.double() * block_cdf[:, -1:]  # [num_reqs, 1]
    # right=True: the first cdf entry above the target, never a zero-mass block or token.
    block_idx = torch.searchsorted(block_cdf, target, right=True)  # [num_reqs, 1]
    mass_before = block_cdf.gather(1, (block_idx - 1).clamp(min=0))
    mass_before.masked_fill_(block_idx == 0, 0.0)
    index = block_idx.unsqueeze(-1).expand(-1, 1, block_size)
    block_probs = blocks.gather(1, index).squeeze(1)  # [num_reqs, block_size]
    inner_cdf = block_probs.cumsum(dim=-1, dtype=torch.float64) + mass_before
    inner_idx = torch.searchsorted(inner_cdf, target, right=True)  # [num_reqs, 1]
    # Rounding may push the target past the block's own sum: take its last non-zero token then.
    last_nonzero = (block_probs > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)
    inner_idx = torch.minimum(inner_idx, last_nonzero)
    return (block_idx * block_size + inner_idx).squeeze(1)


SAMPLING_METHODS = {"exponential": exponential_race_sample, "inverse_cdf": inverse_cdf_sample}


class Sampler:
    """Turns a step's logits [num_reqs, vocab_size] into one sampled token per request."""

    def __init__(self, generator: torch.Generator | None = None, method: str | None = None) -> None:
        # Generator for requests without a seed; None: torch's global generator.
        self.generator = generator
        # None: "inverse_cdf" on CPU (one uniform per request), "exponential" elsewhere (vLLM's).
        if method is not None and method not in SAMPLING_METHODS:
            raise ValueError(f"method={method!r} is invalid: use one of {sorted(SAMPLING_METHODS)}")
        self.method = method

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [num_reqs, vocab_size] (left unmodified)."""
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)
        if raw_logprobs is None and _greedy_on_raw_logits(metadata):
            # NOTE: nothing changes these logits before their argmax, which is the same on the
            # LM head's dtype: float() would write a float32 copy of [rows, vocab] every step.
            sampled = _argmax_rows(logits)
            terminated = advance_matchers(sampled, metadata)
            return SamplerOutput(
                sampled_token_ids=sampled, logprobs=None, terminated_rows=terminated
            )
        original = logits
        logits = logits.float()
        # NOTE: the caller's logits are never modified: penalties return a copy, else clone.
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        elif logits is original and (
            metadata.min_tokens_mask is not None
            or metadata.logit_bias is not None
            or metadata.matchers is not None
        ):
            logits = logits.clone()
        logits = apply_logit_bias(logits, metadata)
        # NOTE: after penalties and bias, so that none can revive a token the grammar forbids;
        # min_tokens comes after the grammar, which it yields to (see apply_min_tokens).
        logits = apply_grammar_bitmask(logits, metadata)
        logits = apply_min_tokens(logits, metadata)
        check_constrained_rows(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(
                raw_logprobs, sampled, metadata.num_logprobs, metadata.max_num_logprobs
            )
        terminated = advance_matchers(sampled, metadata)
        return SamplerOutput(
            sampled_token_ids=sampled, logprobs=logprobs, terminated_rows=terminated
        )

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take the argmax (lowest id on ties); the others sample. [num_reqs] int64."""
        greedy_sampled = None
        if not metadata.all_random:
            greedy_sampled = _argmax_rows(logits)
            if metadata.all_greedy:
                return greedy_sampled
        temperature = metadata.temperature
        if not metadata.all_random:
            temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        logits = logits / temperature.unsqueeze(1)  # a new tensor: the filters below work in place
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None:
            logits = apply_top_k(logits, metadata.top_k)
        if metadata.top_p is not None:
            logits = apply_top_p(logits, metadata.top_p)
        probs = logits.softmax(dim=-1)
        method = self.method or ("inverse_cdf" if probs.device.type == "cpu" else "exponential")
        sampled = SAMPLING_METHODS[method](probs, metadata.generators, self.generator)
        if greedy_sampled is not None:
            greedy_rows = metadata.temperature < SAMPLING_EPS
            sampled = torch.where(greedy_rows, greedy_sampled, sampled)
        return sampled
