"""Beam search on the paged cache: beams fork their parent's blocks and diverge by copy-on-write."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pagedattn.core.request import Request, RequestStatus
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.sampling_params import BeamSearchParams

_beam_ids = itertools.count()


@dataclass
class BeamSequence:
    """A finished beam: its generated tokens, text and scores."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float  # cumulative_logprob / len ** length_penalty
    finish_reason: str


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


@dataclass
class _Beam:
    core: Request
    logprob: float


def _score(logprob: float, length: int, length_penalty: float) -> float:
    return logprob / max(length, 1) ** length_penalty


def run_beam_search(engine, prompt: str | list[int], params: BeamSearchParams) -> BeamSearchOutput:
    """Run beam search for one prompt; needs an otherwise idle engine."""
    if engine.has_unfinished_requests():
        raise InvalidRequestError("beam search needs an idle engine: wait for running requests")
    prompt_ids = engine.tokenize(prompt)
    if not prompt_ids or len(prompt_ids) + params.max_tokens > engine.max_model_len:
        raise InvalidRequestError(
            f"beam search prompt of {len(prompt_ids)} tokens with max_tokens={params.max_tokens} "
            f"must be non-empty and fit max_model_len={engine.max_model_len}",
            param="prompt",
        )
    cache = engine.config.cache
    scheduler, manager = engine.scheduler, engine.kv_cache_manager
    width = params.beam_width

    def new_core() -> Request:
        return Request(
            f"beam-{next(_beam_ids)}",
            prompt_ids,
            block_size=cache.block_size,
            hash_seed=cache.hash_seed,
        )

    root = new_core()
    scheduler.add_request(root, max_tokens=params.max_tokens)
    beams = [_Beam(root, 0.0)]
    done: list[tuple[list[int], float, str]] = []
    pending: dict[str, torch.Tensor] = {}  # beam -> logprobs of its next token
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    try:
        while beams:
            sched = scheduler.schedule()
            seqs = engine.scheduled_seqs(sched)
            logits, sampled_ids = engine.runner.execute(seqs, sched.block_copies)
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_sampled, vocab]
            for row, req_id in enumerate(sampled_ids):
                pending[req_id] = logprobs[row]
            if any(b.core.request_id not in pending for b in beams):
                continue  # a prefill chunk or a preempted beam: wait until every beam has logits
            candidates = []
            for beam in beams:
                top_lp, top_ids = pending.pop(beam.core.request_id).topk(2 * width)
                for lp, tok in zip(top_lp.tolist(), top_ids.tolist(), strict=True):
                    candidates.append((beam.logprob + lp, beam, tok))
            candidates.sort(key=lambda c: c[0], reverse=True)
            chosen = []
            for total, beam, tok in candidates:
                if tok in eos:
                    done.append((beam.core.output_token_ids + [tok], total, "stop"))
                elif len(chosen) < width:
                    chosen.append((total, beam, tok))
                if len(chosen) == width:
                    break
            # NOTE: fork every extra child before any parent appends its token, so the children
            # start from the parent's state; the write of their token then copies the shared
            # partial last block (copy-on-write).
            used: set[str] = set()
            plan = []
            for total, beam, tok in chosen:
                core = beam.core
                if core.request_id in used:
                    child = core.clone(f"beam-{next(_beam_ids)}")
                    manager.fork(core, child)
                    scheduler.add_running_request(child)
                    core = child
                used.add(core.request_id)
                plan.append((core, tok, total))
            dropped = [b.core.request_id for b in beams if b.core.request_id not in used]
            scheduler.finish_requests(dropped, RequestStatus.FINISHED_ABORTED)
            beams = []
            for core, tok, total in plan:
                core.append_output_token_ids(tok)
                if core.num_output_tokens >= params.max_tokens:
                    done.append((list(core.output_token_ids), total, "length"))
                    scheduler.finish_requests(core.request_id, RequestStatus.FINISHED_LENGTH)
                else:
                    beams.append(_Beam(core, total))
            if len(done) >= width and beams:
                best_live = max(
                    _score(b.logprob, b.core.num_output_tokens, params.length_penalty)
                    for b in beams
                )
                worst_kept = sorted(
                    (_score(lp, len(t), params.length_penalty) for t, lp, _ in done), reverse=True
                )[width - 1]
                if best_live < worst_kept and params.length_penalty <= 1.0:
                    break
    finally:
        scheduler.finish_requests(
            [b.core.request_id for b in beams], RequestStatus.FINISHED_ABORTED
        )
    ranked = sorted(
        done, key=lambda d: _score(d[1], len(d[0]), params.length_penalty), reverse=True
    )[:width]
    return BeamSearchOutput(
        prompt_token_ids=prompt_ids,
        sequences=[
            BeamSequence(
                token_ids=ids,
                text=engine.tokenizer.decode(ids, skip_special_tokens=True),
                cumulative_logprob=lp,
                score=_score(lp, len(ids), params.length_penalty),
                finish_reason=reason,
            )
            for ids, lp, reason in ranked
        ],
    )
