"""OpenAIServing: OpenAI completion and chat requests in, engine requests and responses out."""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import AsyncIterator

from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.engine.outputs import RequestOutput
from pagedattn.entrypoints.openai import responses
from pagedattn.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
)
from pagedattn.sampling_params import SamplingParams

Prompt = str | list[int]


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error type, raised by request handlers."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        err_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.err_type = err_type
        self.param = param
        self.code = code


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as outputs arrive; closing this closes them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Token counts over the final outputs of one API request (one per prompt)."""
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.metrics.num_cached_tokens for o in outputs)
        ),
    )


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        max_tokens=max_tokens,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos,
    )


class OpenAIServing:
    """Runs completion and chat requests on an AsyncLLMEngine and shapes OpenAI responses."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        # NOTE: a private copy: the engine thread uses its tokenizer concurrently, and a Rust
        # tokenizer shared across threads can fail with "Already borrowed".
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:
            self.tokenizer = engine.tokenizer

    def models(self) -> ModelList:
        card = ModelCard(id=self.model_name, max_model_len=self.engine.max_model_len)
        return ModelList(data=[card])

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def _start(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Add one engine request per prompt; if one is rejected, abort the others."""
        streams: list[AsyncIterator[RequestOutput]] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(
                        rid, prompt, params, priority=priority, cache_salt=cache_salt
                    )
                )
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    # ---- completions ------------------------------------------------------------------------

    async def create_completion(
        self, req: CompletionRequest, cache_salt: str | None
    ) -> AsyncIterator[str] | dict:
        """A completion response body, or an iterator of server-sent events when streaming."""
        self.check_model(req.model)
        if req.echo:
            raise APIError("echo is not supported: send echo=false", param="echo")
        if req.suffix is not None:
            raise APIError("suffix is not supported: omit it", param="suffix")
        prompts = _completion_prompts(req.prompt)
        params = _sampling_params(req, req.max_tokens, req.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._start(request_id, prompts, params, req.priority, cache_salt)
        builder = responses.CompletionBuilder(
            request_id, self.model_name, self.tokenizer, params, len(prompts)
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(builder, streams, include_usage)
        finals = await _collect(streams)
        return builder.full(finals, usage_of(finals)).model_dump()

    # ---- chat -------------------------------------------------------------------------------

    async def create_chat_completion(
        self, req: ChatCompletionRequest, cache_salt: str | None
    ) -> AsyncIterator[str] | dict:
        """A chat completion body, or an iterator of server-sent events when streaming."""
        self.check_model(req.model)
        prompt = self._render_chat(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(req, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self._start(request_id, [prompt], params, req.priority, cache_salt)
        builder = responses.ChatBuilder(request_id, self.model_name, self.tokenizer, params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(builder, streams, include_usage)
        finals = await _collect(streams)
        return builder.full(finals, usage_of(finals)).model_dump()

    def _render_chat(self, req: ChatCompletionRequest) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"model {self.model_name} has no chat template: use /v1/completions",
                param="messages",
            )
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        # NOTE: the template already holds any BOS token; do not add special tokens again.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- streaming --------------------------------------------------------------------------

    async def _stream(
        self,
        builder: responses.StreamBuilder,
        streams: list[AsyncIterator[RequestOutput]],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge_streams(streams):
                for chunk in builder.chunks(i, out):
                    yield f"data: {chunk.model_dump_json()}\n\n"
                if out.finished:
                    finals[i] = out
            if include_usage:
                usage = usage_of([finals[i] for i in sorted(finals)])
                yield f"data: {builder.usage_chunk(usage).model_dump_json()}\n\n"
        except (InvalidRequestError, ValueError, RuntimeError) as exc:
            yield f"data: {responses.error_json(exc)}\n\n"
        yield "data: [DONE]\n\n"


async def _collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run every stream to its end; the final output of each, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    return [finals[i] for i in sorted(finals)]


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("the prompt is empty: send at least one token", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)
