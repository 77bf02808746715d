"""The engine's view of a user request: its n sequences, their text, logprobs, stops and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.scheduler_output import CoreOutput
from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedattn.engine.stop_strings import find_stop_string
from pagedattn.sampling_params import SamplingParams

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class SeqState:
    """One of the n sequences of a request: its core Request, text so far and stop state."""

    def __init__(
        self, owner: EngineRequest, index: int, core: Request, tokenizer, num_pending: int = 0
    ) -> None:
        """num_pending: the core's last tokens that an output still to be processed carries."""
        self.owner = owner
        self.index = index
        self.core = core
        params = owner.params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, core.prompt_token_ids, params.skip_special_tokens
        )
        self.text = ""
        prior = core.output_token_ids[: len(core.output_token_ids) - num_pending]
        if prior and params.detokenize:  # a fork that starts mid-sequence
            self.text = self.detokenizer.add_tokens(list(prior))
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Tokens of the output (None: all); set when a stop string ends it inside a step's tokens.
        self.num_token_ids: int | None = None

    def on_output(self, out: CoreOutput, now: float) -> bool:
        """Record the scheduler's output for this sequence; True if a stop string ended it.

        The scheduler already applied EOS, stop token ids and length; stop strings are checked
        here, on the detokenised text, and the caller then finishes the sequence in the scheduler.
        """
        owner = self.owner
        params = owner.params
        if out.status == RequestStatus.FINISHED_ERROR:
            self.finish_reason = "error"
            owner.error = owner.error or out.error or "the request failed"
            return False
        metrics = owner.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        status = out.status
        num_new = len(out.new_token_ids)
        # NOTE: a speculative step brings several tokens: each is checked as if alone, and a
        # stop string ends the sequence at the token that completed it.
        for i, token in enumerate(out.new_token_ids):
            lp = out.logprobs
            if lp is not None:
                # NOTE: best_of ranks by cumulative logprob even when no logprobs are returned.
                self.cumulative_logprob += lp.sampled_logprob
                if self.logprobs is not None:
                    self.logprobs.append(_entry(token, lp))
            delta = self.detokenizer.add_tokens([token]) if params.detokenize else ""
            self.text += delta
            is_last = i == num_new - 1
            if is_last and status == RequestStatus.FINISHED_STOPPED:
                # The stop token's own text is dropped unless asked for (as vLLM does).
                if delta and not params.include_stop_str_in_output:
                    self.text = self.text[: len(self.text) - len(delta)]
                self.finish_reason, self.stop_reason = "stop", out.stop_reason
                return False
            num_output = self.core.num_output_tokens - (num_new - 1 - i)
            if params.stop and delta and num_output >= params.min_tokens:
                found = find_stop_string(
                    self.text, len(delta), params.stop, params.include_stop_str_in_output
                )
                if found is not None:
                    self.stop_reason, cut = found
                    self.text = self.text[:cut]
                    self.finish_reason = "stop"
                    if not is_last:
                        self.num_token_ids = num_output
                    return status is None or not is_last
        if status is not None:
            self.finish_reason = _FINISH_REASON[status]
        return False

    def make_output(self) -> CompletionOutput:
        """The sequence so far."""
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=self.core.output_token_ids[: self.num_token_ids],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=(
                self.cumulative_logprob
                if self.logprobs is not None or self.owner.num_seqs > self.owner.params.n
                else None
            ),
        )


def _entry(token: int, lp) -> dict[int, Logprob]:
    """One position's logprobs: the chosen token's, then the top ones with their ranks."""
    entry = {token: Logprob(lp.sampled_logprob, lp.sampled_rank)}
    for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
        entry.setdefault(tid, Logprob(value, rank))
    return entry


@dataclass
class EngineRequest:
    """A user request as the engine tracks it (n > 1 sequences fork from sequence 0)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    priority: int = 0
    seqs: list[SeqState] = field(default_factory=list)
    error: str | None = None
    metrics: RequestMetrics = field(init=False)
    # With prompt_logprobs: position -> its entry (position 0 has none).
    prompt_logprobs: dict[int, dict[int, Logprob]] | None = None

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = {}

    @property
    def num_seqs(self) -> int:
        """Sequences generated: best_of candidates (n of them returned), else n."""
        return max(self.params.best_of or 0, self.params.n)

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        return len(self.seqs) == self.num_seqs and all(
            s.finish_reason is not None for s in self.seqs
        )

    def add_prompt_logprobs(self, entries: list) -> None:
        """Record prompt-token logprobs a step computed (a recompute repeats none)."""
        if self.prompt_logprobs is None:
            return
        for position, lp in entries:
            token = self.prompt_token_ids[position]
            self.prompt_logprobs.setdefault(position, _entry(token, lp))

    def make_output(self) -> RequestOutput:
        metrics = self.metrics
        metrics.num_cached_tokens = self.seqs[0].core.num_cached_tokens
        metrics.num_generated_tokens = max(s.core.num_output_tokens for s in self.seqs)
        metrics.num_preemptions = sum(s.core.num_preemptions for s in self.seqs)
        metrics.num_recomputed_tokens = sum(s.core.num_recomputed_tokens for s in self.seqs)
        outputs = [s.make_output() for s in self.seqs]
        if self.num_seqs > self.params.n:
            # best_of: the n candidates with the highest cumulative logprob, once all are done.
            if not self.finished:
                outputs = []
            else:
                outputs.sort(key=lambda o: -o.cumulative_logprob)
                outputs = outputs[: self.params.n]
                for index, out in enumerate(outputs):
                    out.index = index
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            num_prompt = len(self.prompt_token_ids)
            prompt_logprobs = [None] + [self.prompt_logprobs.get(p) for p in range(1, num_prompt)]
        if self.error is not None:
            for out in outputs:
                out.finish_reason = "error"
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_tokens,
            error=self.error,
            prompt_logprobs=prompt_logprobs,
        )
