"""The engine's view of a user request: its n sequences, their text, logprobs, stops and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedattn.core.request import Request, RequestStatus
from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedattn.sampling_params import SamplingParams
from pagedattn.worker.logprobs import TokenLogprobs
from pagedattn.worker.stop_checker import check_stop

_STATUS_OF_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
}


class SeqState:
    """One of the n sequences of a request: its core Request, text so far and stop state."""

    def __init__(
        self,
        owner: EngineRequest,
        index: int,
        core: Request,
        tokenizer,
        generator: torch.Generator | None,
    ) -> None:
        self.owner = owner
        self.index = index
        self.core = core
        self.generator = generator
        params = owner.params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, core.prompt_token_ids, params.skip_special_tokens
        )
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.tokenizer = tokenizer

    def on_token(
        self, token: int, logprobs: TokenLogprobs | None, now: float
    ) -> RequestStatus | None:
        """Record a sampled token; return the finished status if this token ends the sequence."""
        owner = self.owner
        params = owner.params
        metrics = owner.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if logprobs is not None and self.logprobs is not None:
            entry = {token: Logprob(logprobs.sampled_logprob, logprobs.sampled_rank)}
            for rank, (tid, lp) in enumerate(
                zip(logprobs.top_token_ids, logprobs.top_logprobs, strict=True), start=1
            ):
                entry.setdefault(tid, Logprob(lp, rank))
            self.logprobs.append(entry)
            self.cumulative_logprob += logprobs.sampled_logprob
        delta = self.detokenizer.add_tokens([token]) if params.detokenize else ""
        self.text += delta
        # NOTE: called after the token was appended to self.core.output_token_ids.
        result = check_stop(
            self.core.output_token_ids,
            self.text,
            params,
            owner.eos_token_ids,
            owner.max_tokens,
            num_new_chars=len(delta),
        )
        if result.finish_reason is None:
            return None
        self.finish_reason, self.stop_reason, self.text = result
        return _STATUS_OF_REASON[self.finish_reason]

    def make_output(self) -> CompletionOutput:
        """The sequence so far (call after the step appended its token)."""
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.core.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )


@dataclass
class EngineRequest:
    """A user request as the engine tracks it (n > 1 sequences fork from sequence 0)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    seqs: list[SeqState] = field(default_factory=list)
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    def needs_fork(self) -> bool:
        """True until the n - 1 siblings of sequence 0 exist."""
        return len(self.seqs) < self.params.n

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(
            s.finish_reason is not None for s in self.seqs
        )

    def make_output(self) -> RequestOutput:
        metrics = self.metrics
        metrics.num_cached_tokens = self.seqs[0].core.num_cached_tokens
        metrics.num_generated_tokens = max(s.core.num_output_tokens for s in self.seqs)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.make_output() for s in self.seqs],
            finished=self.finished,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens,
        )
