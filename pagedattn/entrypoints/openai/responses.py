"""Shaping engine outputs into OpenAI bodies: whole responses, streamed deltas and logprobs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from pagedattn.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedattn.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDeltaMessage,
    ChatLogProbs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    TopLogprob,
    UsageInfo,
)
from pagedattn.entrypoints.openai.tool_protocol import FunctionCallOut, ToolCallOut
from pagedattn.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedattn.entrypoints.openai.chat_output import ChatOutputParser

# OpenAI's stand-in for the logprob of a token that is missing from the returned distribution.
MISSING_LOGPROB = -9999.0


def error_json(exc: BaseException) -> str:
    """A server-sent error event's payload for an error raised mid-stream."""
    from pagedattn.entrypoints.openai.http import error_payload

    # NOTE: the same body (message, type, code) as a non-streamed answer to the same error.
    return json.dumps(error_payload(exc)["body"])


def _merge_logprobs(first: CompletionLogProbs, second: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def _ranked(entry: dict[int, Logprob], sampled: int, num_top: int) -> list[tuple[int, Logprob]]:
    """The sampled token and the `num_top` most likely, most likely first."""
    items = sorted(entry.items(), key=lambda kv: kv[1].rank)
    return [(t, lp) for t, lp in items if lp.rank <= num_top or t == sampled]


class _Decoder:
    """Token id -> text, cached (logprob tokens repeat a lot)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


class StreamBuilder:
    """Turns cumulative outputs into per-choice deltas; subclasses shape the chunks."""

    def __init__(
        self, request_id: str, model_name: str, tokenizer, params: SamplingParams, num_prompts=1
    ) -> None:
        self.request_id = request_id
        self.model_name = model_name
        self.decode = _Decoder(tokenizer)
        self.n = params.n
        self.num_top = params.logprobs
        # NOTE: text that may be the start of a stop string is held back until it is not: the
        # engine cuts a matched stop string from the text, and a sent delta cannot be taken back.
        self.holdback = params.output_text_buffer_length
        self.num_prompts = num_prompts
        self._sent_chars: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}
        self._done: set[int] = set()

    def deltas(
        self, prompt_index: int, out: RequestOutput
    ) -> Iterator[tuple[int, CompletionOutput, str, int]]:
        """(choice index, output, new text, index of the first unsent token) per moved choice."""
        for comp in out.outputs:
            key = prompt_index * self.n + comp.index
            if key in self._done:
                continue
            final = comp.finish_reason is not None
            start = self._sent_chars.get(key, 0)
            end = len(comp.text) if final else max(start, len(comp.text) - self.holdback)
            first_token = self._sent_tokens.get(key, 0)
            new_tokens = len(comp.token_ids) > first_token
            if end == start and not final and not (self.num_top is not None and new_tokens):
                continue
            self._sent_chars[key] = end
            self._sent_tokens[key] = len(comp.token_ids)
            if final:
                self._done.add(key)
            yield key, comp, comp.text[start:end], first_token

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterator:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo):
        raise NotImplementedError


class CompletionBuilder(StreamBuilder):
    """Bodies of ``/v1/completions``; with `echo`, each choice starts with its prompt's text."""

    def __init__(
        self,
        request_id: str,
        model_name: str,
        tokenizer,
        params: SamplingParams,
        num_prompts: int = 1,
        echo: list[str] | None = None,
    ) -> None:
        super().__init__(request_id, model_name, tokenizer, params, num_prompts)
        self.echo = echo
        self._echoed: set[int] = set()

    def _prompt_logprobs(self, out: RequestOutput) -> CompletionLogProbs:
        """The prompt's tokens and logprobs (None where the engine gave none: the first)."""
        result = CompletionLogProbs()
        entries = getattr(out, "prompt_logprobs", None) or []
        offset = 0
        for pos, tid in enumerate(out.prompt_token_ids):
            token = self.decode(tid)
            entry = entries[pos] if pos < len(entries) else None
            sampled = entry.get(tid) if entry else None
            result.tokens.append(token)
            result.token_logprobs.append(None if sampled is None else sampled.logprob)
            result.top_logprobs.append(
                None
                if not entry
                else {self.decode(t): lp.logprob for t, lp in _ranked(entry, tid, self.num_top)}
            )
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _with_echo(
        self, key: int, prompt_index: int, out: RequestOutput, choice: CompletionChoice
    ) -> CompletionChoice:
        """Prefix the prompt (text, and logprobs when asked) to a choice's first delta."""
        if self.echo is None or key in self._echoed:
            return choice
        self._echoed.add(key)
        prefix = self.echo[prompt_index]
        choice.text = prefix + choice.text
        if choice.logprobs is not None:
            shifted = [o + len(prefix) for o in choice.logprobs.text_offset]
            choice.logprobs.text_offset = shifted
            choice.logprobs = _merge_logprobs(self._prompt_logprobs(out), choice.logprobs)
        return choice

    def _logprobs(self, comp: CompletionOutput, first: int, offset: int) -> CompletionLogProbs:
        result = CompletionLogProbs()
        for tid, entry in zip(comp.token_ids[first:], comp.logprobs[first:], strict=False):
            token = self.decode(tid)
            sampled = entry.get(tid)
            result.tokens.append(token)
            result.token_logprobs.append(None if sampled is None else sampled.logprob)
            result.top_logprobs.append(
                {self.decode(t): lp.logprob for t, lp in _ranked(entry, tid, self.num_top)}
            )
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def _choice(self, key: int, comp: CompletionOutput, text: str, first: int, offset: int):
        logprobs = None
        if self.num_top is not None and comp.logprobs is not None:
            logprobs = self._logprobs(comp, first, offset)
        return CompletionChoice(
            index=key,
            text=text,
            logprobs=logprobs,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
        )

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterator[CompletionResponse]:
        for key, comp, text, first in self.deltas(prompt_index, out):
            offset = self._sent_chars[key] - len(text)
            choice = self._with_echo(
                key, prompt_index, out, self._choice(key, comp, text, first, offset)
            )
            yield CompletionResponse(id=self.request_id, model=self.model_name, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, model=self.model_name, choices=[], usage=usage
        )

    def full(self, finals: list[RequestOutput], usage: UsageInfo) -> CompletionResponse:
        choices = [
            self._with_echo(
                i * self.n + comp.index,
                i,
                out,
                self._choice(i * self.n + comp.index, comp, comp.text, 0, 0),
            )
            for i, out in enumerate(finals)
            for comp in sorted(out.outputs, key=lambda c: c.index)
        ]
        return CompletionResponse(
            id=self.request_id, model=self.model_name, choices=choices, usage=usage
        )


class ChatBuilder(StreamBuilder):
    """Bodies of ``/v1/chat/completions``; `make_parser` (reasoning and tool calls) per choice."""

    def __init__(
        self,
        request_id: str,
        model_name: str,
        tokenizer,
        params: SamplingParams,
        make_parser: Callable[[], ChatOutputParser] | None = None,
    ):
        super().__init__(request_id, model_name, tokenizer, params)
        self._started: set[int] = set()
        self.make_parser = make_parser
        self._parsers: dict[int, ChatOutputParser] = {}

    def _top(self, token_id: int, lp: Logprob) -> TopLogprob:
        token = self.decode(token_id)
        return TopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode()))

    def _logprobs(self, comp: CompletionOutput, first: int) -> ChatLogProbs | None:
        if self.num_top is None or comp.logprobs is None:
            return None
        content = []
        for tid, entry in zip(comp.token_ids[first:], comp.logprobs[first:], strict=False):
            token = self.decode(tid)
            sampled = entry.get(tid)
            top = [
                self._top(t, lp)
                for t, lp in _ranked(entry, tid, self.num_top)
                if lp.rank <= self.num_top
            ]
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=MISSING_LOGPROB if sampled is None else sampled.logprob,
                    bytes=list(token.encode()),
                    top_logprobs=top,
                )
            )
        return ChatLogProbs(content=content)

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, model=self.model_name, choices=[choice])

    def chunks(self, prompt_index: int, out: RequestOutput) -> Iterator[ChatCompletionChunk]:
        for key, comp, text, first in self.deltas(prompt_index, out):
            if key not in self._started:
                self._started.add(key)
                role = ChatDeltaMessage(role="assistant", content="")
                yield self._chunk(ChatChunkChoice(index=key, delta=role))
            final = comp.finish_reason is not None
            finish_reason = comp.finish_reason
            if self.make_parser is None:
                deltas = [ChatDeltaMessage(content=text)]
            else:
                parser = self._parsers.setdefault(key, self.make_parser())
                deltas = [
                    ChatDeltaMessage(
                        content=d.content,
                        reasoning_content=d.reasoning,
                        tool_calls=d.tool_calls or None,
                    )
                    for d in parser.feed(text, final)
                ]
                if final and parser.num_calls and finish_reason == "stop":
                    finish_reason = "tool_calls"
            logprobs = self._logprobs(comp, first)
            if not deltas and (final or logprobs is not None):
                deltas = [ChatDeltaMessage(content="")]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                choice = ChatChunkChoice(
                    index=key,
                    delta=delta,
                    logprobs=logprobs if i == 0 else None,
                    finish_reason=finish_reason if last else None,
                    stop_reason=comp.stop_reason if last else None,
                )
                yield self._chunk(choice)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, model=self.model_name, choices=[], usage=usage
        )

    def full(self, finals: list[RequestOutput], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [
            self._full_choice(comp)
            for out in finals
            for comp in sorted(out.outputs, key=lambda c: c.index)
        ]
        return ChatCompletionResponse(
            id=self.request_id, model=self.model_name, choices=choices, usage=usage
        )

    def _full_choice(self, comp: CompletionOutput) -> ChatChoice:
        message = ChatResponseMessage(role="assistant", content=comp.text)
        finish_reason = comp.finish_reason
        if self.make_parser is not None:
            parsed = self.make_parser().whole(comp.text)
            message.content = parsed.content
            message.reasoning_content = parsed.reasoning
            message.tool_calls = [
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in parsed.calls
            ]
            if parsed.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return ChatChoice(
            index=comp.index,
            message=message,
            logprobs=self._logprobs(comp, 0),
            finish_reason=finish_reason,
            stop_reason=comp.stop_reason,
        )
