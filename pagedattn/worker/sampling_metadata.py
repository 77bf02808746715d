"""SamplingMetadata: the per-step sampling tensors of a batch, built from the requests' params."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedattn.sampling_params import SAMPLING_EPS, SamplingParams

if TYPE_CHECKING:
    from pagedattn.structured_output.matcher import Matcher


@dataclass
class SamplingMetadata:
    """Sampling inputs for one step, one row per request; None fields are skipped by the sampler."""

    num_reqs: int
    all_greedy: bool
    all_random: bool
    # [num_reqs] float32; greedy rows hold 0.0. None when every request is greedy.
    temperature: torch.Tensor | None = None
    # [num_reqs] float32 in (0, 1]. None when no request uses top-p.
    top_p: torch.Tensor | None = None
    # [num_reqs] int64 in [1, vocab_size]; vocab_size = off. None when no request uses top-k.
    top_k: torch.Tensor | None = None
    # [num_reqs] float32 in [0, 1]. None when no request uses min-p.
    min_p: torch.Tensor | None = None
    # Batch row -> the request's own generator (seeded requests only).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    no_penalties: bool = True
    # [num_reqs] float32 each; set together when any request has a penalty.
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    # [num_reqs, max_len] int64, padded with vocab_size (a column the sampler drops).
    output_token_ids: torch.Tensor | None = None
    # Only when some request has a repetition penalty (it also covers the prompt).
    prompt_token_ids: torch.Tensor | None = None
    # (rows, token ids) of stop tokens to forbid: requests still short of min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # Per row: None (no logprobs) or the number of top logprobs. None when no request asks.
    num_logprobs: list[int | None] | None = None
    max_num_logprobs: int | None = None
    # (rows, token ids, biases) added to the logits: OpenAI's logit_bias. None when unused.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Per row: the request's grammar matcher, or None. None when no request is constrained.
    matchers: list[Matcher | None] | None = None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator: the same seed gives the same tokens in any batch."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _pad(token_ids_list: Sequence[Sequence[int]], pad_id: int, device) -> torch.Tensor:
    max_len = max((len(ids) for ids in token_ids_list), default=0)
    padded = [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_ids_list]
    return torch.tensor(padded, dtype=torch.int64, device=device)  # [num_reqs, max_len]


def build_sampling_metadata(
    params_list: Sequence[SamplingParams],
    output_token_ids_list: Sequence[Sequence[int]],
    prompt_token_ids_list: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None] | None,
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
    num_output_tokens_list: Sequence[int] | None = None,
    *,
    device: torch.device | str = "cpu",
    matchers: Sequence[Matcher | None] | None = None,
) -> SamplingMetadata:
    """Build one step's SamplingMetadata; an all-greedy batch without extras costs one pass.

    `matchers`: one per row, the request's structured-output Matcher or None (the runner keeps
    them, made by `pagedattn.structured_output.new_matcher`); the sampler masks and advances them.
    """
    num_reqs = len(params_list)
    if num_output_tokens_list is None:
        num_output_tokens_list = [len(ids) for ids in output_token_ids_list]
    greedy = [p.temperature < SAMPLING_EPS for p in params_list]
    all_greedy = all(greedy)
    meta = SamplingMetadata(num_reqs=num_reqs, all_greedy=all_greedy, all_random=not any(greedy))

    def _floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    if not all_greedy:
        meta.temperature = _floats([p.temperature for p in params_list])
        if any(p.top_p < 1.0 for p in params_list):
            meta.top_p = _floats([p.top_p for p in params_list])
        if any(p.top_k is not None for p in params_list):
            top_k = [
                vocab_size if p.top_k is None else min(p.top_k, vocab_size) for p in params_list
            ]
            meta.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
        if any(p.min_p > 0.0 for p in params_list):
            meta.min_p = _floats([p.min_p for p in params_list])
        if generators is not None:
            meta.generators = {
                i: g for i, g in enumerate(generators) if g is not None and not greedy[i]
            }

    if any(p.has_penalties for p in params_list):
        meta.no_penalties = False
        meta.presence_penalties = _floats([p.presence_penalty for p in params_list])
        meta.frequency_penalties = _floats([p.frequency_penalty for p in params_list])
        meta.repetition_penalties = _floats([p.repetition_penalty for p in params_list])
        meta.output_token_ids = _pad(output_token_ids_list, vocab_size, device)
        if any(p.repetition_penalty != 1.0 for p in params_list):
            meta.prompt_token_ids = _pad(prompt_token_ids_list, vocab_size, device)

    rows: list[int] = []
    cols: list[int] = []
    for i, (p, num_output) in enumerate(zip(params_list, num_output_tokens_list, strict=True)):
        if num_output < p.min_tokens:
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(eos_token_ids)
            ids = sorted(t for t in stop_ids if t < vocab_size)
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if rows:
        meta.min_tokens_mask = (
            torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(cols, dtype=torch.int64, device=device),
        )

    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i, p in enumerate(params_list):
        for token_id, bias in (p.logit_bias or {}).items():
            if token_id < vocab_size:
                bias_rows.append(i)
                bias_ids.append(token_id)
                bias_values.append(bias)
    if bias_rows:
        meta.logit_bias = (
            torch.tensor(bias_rows, dtype=torch.int64, device=device),
            torch.tensor(bias_ids, dtype=torch.int64, device=device),
            _floats(bias_values),
        )

    if matchers is not None and any(m is not None for m in matchers):
        if len(matchers) != num_reqs:
            raise ValueError(f"got {len(matchers)} matchers for {num_reqs} rows: pass one per row")
        meta.matchers = list(matchers)

    if any(p.logprobs is not None for p in params_list):
        meta.num_logprobs = [p.logprobs for p in params_list]
        meta.max_num_logprobs = max(k for k in meta.num_logprobs if k is not None)
    return meta
