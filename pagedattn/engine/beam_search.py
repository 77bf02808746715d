"""Beam search on the paged cache: beams fork their parent's blocks and diverge by copy-on-write.

It drives the engine through its public API only: ``add_request``, ``step``, ``fork_request``
(with the beam's chosen token in place of the sampled one) and ``abort_request``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pagedattn.engine.errors import InvalidRequestError
from pagedattn.sampling_params import BeamSearchParams, SamplingParams

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
    request_id: str
    token_ids: list[int]  # generated so far, the chosen last token included
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
    width = params.beam_width
    # NOTE: every beam must run every step (no preemption) for the beams to stay in lockstep.
    engine.check_fits_together(width, len(prompt_ids) + params.max_tokens + 1)
    # NOTE: every beam samples greedily and reports its 2 * width best next tokens; the search
    # then forks the beams it keeps with their chosen token in place of the sampled one.
    step_params = SamplingParams.for_beam_step(width, max_tokens=params.max_tokens + 1)
    root = f"beam-{next(_beam_ids)}"
    engine.add_request(root, prompt_ids, step_params)
    beams = [_Beam(root, [], 0.0)]
    done: list[tuple[list[int], float, str]] = []
    eos = set() if params.ignore_eos else set(engine.eos_token_ids)
    try:
        while beams:
            top = _next_token_logprobs(engine, {b.request_id for b in beams})
            candidates = []
            for beam in beams:
                for token, lp in top[beam.request_id]:
                    candidates.append((beam.logprob + lp, beam, token))
            candidates.sort(key=lambda c: c[0], reverse=True)
            chosen = []
            for total, beam, token in candidates:
                if token in eos:
                    done.append((beam.token_ids + [token], total, "stop"))
                elif len(chosen) < width:
                    chosen.append((total, beam, token))
                if len(chosen) == width:
                    break
            new_beams = []
            for total, beam, token in chosen:
                token_ids = beam.token_ids + [token]
                if len(token_ids) >= params.max_tokens:
                    done.append((token_ids, total, "length"))
                    continue
                child = f"beam-{next(_beam_ids)}"
                engine.fork_request(beam.request_id, child, last_token_id=token)
                new_beams.append(_Beam(child, token_ids, total))
            engine.abort_request([b.request_id for b in beams])
            beams = new_beams
            if len(done) >= width and beams and params.length_penalty <= 1.0:
                best_live = max(
                    _score(b.logprob, len(b.token_ids), params.length_penalty) for b in beams
                )
                worst_kept = sorted(
                    (_score(lp, len(t), params.length_penalty) for t, lp, _ in done), reverse=True
                )[width - 1]
                if best_live < worst_kept:
                    break
    finally:
        engine.abort_request([b.request_id for b in beams])
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


def _next_token_logprobs(engine, beam_ids: set[str]) -> dict[str, list[tuple[int, float]]]:
    """Step until every beam sampled its next token; each beam's top (token, logprob) pairs."""
    top: dict[str, list[tuple[int, float]]] = {}
    while len(top) < len(beam_ids):
        outputs = engine.step()
        for out in outputs:
            if out.request_id not in beam_ids:
                continue
            if out.error is not None:
                raise InvalidRequestError(f"beam search failed: {out.error}")
            if out.request_id in top:
                raise RuntimeError("beam search lost lockstep: a beam ran a step ahead")
            entry = out.outputs[0].logprobs[-1]
            top[out.request_id] = [(t, lp.logprob) for t, lp in entry.items()]
        if not outputs and not engine.has_unfinished_requests():
            raise RuntimeError("beam search: the engine finished its beams unexpectedly")
    return top
