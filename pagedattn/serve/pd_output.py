"""The client's view of a disaggregated request: the prefill's first token joined to the decode.

The decode half detokenises and checks stop strings over its own tokens only, from a prompt that
ends with the first token; alone it would miss a stop string that starts in the first token's
text, and lose the text of a first token that is an incomplete UTF-8 character (its bytes sit in
the decode half's prompt). ``JoinedOutput`` redoes both over the joined tokens, token by token as
one engine does (``SeqState.on_output``), and rewrites the timings to the client's.
"""

from __future__ import annotations

import dataclasses
import time

from pagedattn.engine.detokenizer import IncrementalDetokenizer
from pagedattn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedattn.engine.stop_strings import find_stop_string
from pagedattn.sampling_params import SamplingParams


class JoinedOutput:
    """One disaggregated request (n == 1): the first output, then each decode output joined."""

    def __init__(
        self,
        first: RequestOutput,
        params: SamplingParams,
        tokenizer,
        arrival_time: float,
        first_token_time: float,
    ) -> None:
        self.first = first
        self.params = params
        self.arrival_time = arrival_time
        self.first_token_time = first_token_time
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, first.prompt_token_ids, params.skip_special_tokens
        )
        self.token_ids = list(first.outputs[0].token_ids)
        # NOTE: the same detokenizer state as the prefill engine's, so the same first text.
        self.text = self._detokenizer.add_tokens(self.token_ids) if params.detokenize else ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._num_decode_seen = 0

    def first_output(self, finished: bool) -> RequestOutput:
        """The first token alone: finished when it ended the request, else the decode goes on."""
        if finished:
            self.finish_reason = self.first.outputs[0].finish_reason
            return dataclasses.replace(self.first, metrics=self._metrics(None))
        comp = dataclasses.replace(
            self.first.outputs[0], text=self.text, finish_reason=None, stop_reason=None
        )
        return dataclasses.replace(
            self.first, outputs=[comp], finished=False, metrics=self._metrics(None)
        )

    def add(self, out: RequestOutput) -> RequestOutput:
        """Join a decode output; the result is finished when the decode half or a stop string
        over the joined text ended the request (the caller then aborts the decode half)."""
        comp = out.outputs[0]
        new = comp.token_ids[self._num_decode_seen :]
        self._num_decode_seen = len(comp.token_ids)
        for i, token in enumerate(new):
            if self._add_token(token, i == len(new) - 1, comp):
                break
        else:
            if comp.finish_reason is not None and self.finish_reason is None:
                self.finish_reason, self.stop_reason = comp.finish_reason, comp.stop_reason
        return dataclasses.replace(
            out,
            prompt=self.first.prompt,
            prompt_token_ids=self.first.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=comp.index,
                    text=self.text,
                    token_ids=list(self.token_ids),
                    finish_reason=self.finish_reason,
                    stop_reason=self.stop_reason,
                )
            ],
            finished=self.finish_reason is not None,
            num_cached_tokens=self.first.num_cached_tokens,
            metrics=self._metrics(out.metrics),
        )

    def _add_token(self, token: int, is_last: bool, comp: CompletionOutput) -> bool:
        """Append one token as SeqState.on_output does; True when it ended the request."""
        params = self.params
        delta = self._detokenizer.add_tokens([token]) if params.detokenize else ""
        self.text += delta
        self.token_ids.append(token)
        if is_last and comp.finish_reason == "stop" and not isinstance(comp.stop_reason, str):
            # EOS or a stop token id: its text is dropped unless asked for (as one engine does).
            if delta and not params.include_stop_str_in_output:
                self.text = self.text[: len(self.text) - len(delta)]
            self.finish_reason, self.stop_reason = "stop", comp.stop_reason
            return True
        if params.stop and delta and len(self.token_ids) >= params.min_tokens:
            found = find_stop_string(
                self.text, len(delta), params.stop, params.include_stop_str_in_output
            )
            if found is not None:
                self.stop_reason, cut = found
                self.text = self.text[:cut]
                self.finish_reason = "stop"
                return True
        return False

    def _metrics(self, decode: RequestMetrics | None) -> RequestMetrics:
        """The client's timings on this replica's clock: arrival at the decode replica, first
        token when the prefill's came back; scheduling and counters from both halves."""
        prefill = self.first.metrics
        scheduled = None
        if prefill.first_scheduled_time is not None:
            # NOTE: the prefill replica's clock is not ours: carry over its queueing delay only.
            scheduled = self.arrival_time + prefill.first_scheduled_time - prefill.arrival_time
        base = decode if decode is not None else prefill
        finished = None if decode is None else decode.finished_time
        return dataclasses.replace(
            base,
            arrival_time=self.arrival_time,
            first_scheduled_time=scheduled,
            first_token_time=self.first_token_time,
            last_token_time=base.last_token_time if decode is not None else self.first_token_time,
            finished_time=finished
            if finished is not None or self.finish_reason is None
            else time.monotonic(),
            num_cached_tokens=prefill.num_cached_tokens,
            num_preemptions=prefill.num_preemptions + (decode.num_preemptions if decode else 0),
            num_generated_tokens=len(self.token_ids),
        )
