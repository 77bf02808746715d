"""OpenAIServing: OpenAI completion and chat requests in, engine requests and responses out."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pagedattn.chat_template import template_supports_tools
from pagedattn.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.engine.outputs import RequestOutput
from pagedattn.entrypoints.openai import chat_tools, responses
from pagedattn.entrypoints.openai.chat_output import ChatOutputParser
from pagedattn.entrypoints.openai.grammars import ServingGrammars
from pagedattn.entrypoints.openai.preprocess import PromptPreprocessor
from pagedattn.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
)
from pagedattn.entrypoints.openai.reasoning_grammar import after_reasoning
from pagedattn.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedattn.entrypoints.openai.request_checks import check_chat_fields, check_lora_request
from pagedattn.entrypoints.openai.request_params import sampling_params_of, structured_outputs_of
from pagedattn.entrypoints.openai.tool_parsers import HermesToolParser, get_tool_parser
from pagedattn.entrypoints.openai.worker_pool import WorkerPool
from pagedattn.lora.request import LoRARequest
from pagedattn.sampling_params import SamplingParams
from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

Prompt = str | list[int]
# A grammar compile waits at most this long for the compiler, then runs at most this long
# (killed past it): a 400 constraint_timeout either way (grammars.py).
DEFAULT_GRAMMAR_TIMEOUT_S = 20.0
# Grammar compiles waiting for the compile worker before new ones are refused with 503.
MAX_QUEUED_COMPILES = 4


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
            cached_tokens=sum(_num_cached_tokens(o) for o in outputs)
        ),
    )


def _num_cached_tokens(out: RequestOutput) -> int:
    return max(out.num_cached_tokens or 0, out.metrics.num_cached_tokens or 0)


if TYPE_CHECKING:
    from pagedattn.entrypoints.openai.lora_routes import ServingLoRA


class OpenAIServing:
    """Runs completion and chat requests on an AsyncLLMEngine and shapes OpenAI responses."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_name: str,
        *,
        max_prompt_chars: int | None = None,
        grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
        loras: ServingLoRA | None = None,
        tool_call_parser: str | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: str | None = None,
    ) -> None:
        """tool_call_parser / reasoning_parser: names from tool_parsers.py / reasoning_parsers.py
        (`--tool-call-parser`, `--reasoning-parser`); ValueError for an unknown one."""
        self.engine = engine
        self.tool_parser = None if tool_call_parser is None else get_tool_parser(tool_call_parser)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = (
            None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        )
        self.model_name = served_model_name
        # LoRA adapters by name (the `model` field selects one); None: the base model only.
        self.loras = loras
        self.preprocessor = PromptPreprocessor(
            engine.tokenizer, engine.max_model_len, max_prompt_chars=max_prompt_chars
        )
        # NOTE: responses decode on the event loop with the preprocessor's own copy (the engine
        # thread uses the engine's tokenizer concurrently).
        self.tokenizer = self.preprocessor.local_tokenizer()
        # NOTE: grammars compile on their own worker, never on the tokenisers' (a slow compile
        # must not hold up text prompts), in a process killed at the deadline; cached ones at once.
        self.grammars = ServingGrammars(
            self.tokenizer, engine.vocab_size, grammar_timeout_s, MAX_QUEUED_COMPILES
        )
        self.grammar_pool = self.grammars.pool
        self.grammar_timeout_s = grammar_timeout_s
        from pagedattn import envs

        # PAGEDATTN_TRACE_HOPS: each streamed event says when the engine made its token and
        # when this event loop read it (SSE comment lines; `bench pd --trace-hops`).
        self.trace_hops = envs.PAGEDATTN_TRACE_HOPS

    @property
    def pools(self) -> tuple[WorkerPool, ...]:
        """The worker pools of this front end (for /health; a grammar compile is bounded by its
        deadline, so the compile worker is not one of them)."""
        return self.preprocessor.pools

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        self.grammars.close()

    def models(self, tenant: str | None = None) -> ModelList:
        """The base model and the adapters `tenant` (a key salt) may use."""
        card = ModelCard(id=self.model_name, max_model_len=self.engine.max_model_len)
        max_len = self.engine.max_model_len
        adapters = [] if self.loras is None else self.loras.cards(max_len, tenant)
        return ModelList(data=[card, *adapters])

    def check_model(self, model: str, tenant: str | None = None) -> LoRARequest | None:
        """The adapter the `model` field names and `tenant` may use (None: the base model);
        else a 404."""
        if self.loras is not None:
            return self.loras.resolve(model, tenant)
        if model != self.model_name:
            raise APIError(
                f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                status_code=404,
                param="model",
                code="model_not_found",
            )

    async def _compile(self, structured: StructuredOutputsParams | None, param: str | None):
        """Compile the grammar now (cached), so that one that cannot compile is a 400."""
        await self.grammars.compile(structured, param)

    async def _start(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        owner: str | None,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Add one engine request per prompt; if one is rejected, abort the others."""
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(
                        rid,
                        prompt,
                        params,
                        priority=priority,
                        cache_salt=cache_salt,
                        owner=owner,
                        lora_request=lora_request,
                    )
                )
        except BaseException:
            # NOTE: RequestStream.aclose aborts even a stream that was never iterated.
            for s in streams:
                await s.aclose()
            raise
        return streams

    def _log_user(self, request_id: str, req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.user is not None:
            logger.debug("request %s from user %r", request_id, req.user)

    # ---- completions ------------------------------------------------------------------------

    async def create_completion(
        self, req: CompletionRequest, cache_salt: str | None, owner: str | None = None
    ) -> AsyncIterator[str] | dict:
        """A completion response body, or an iterator of server-sent events when streaming."""
        lora = self.check_model(req.model, owner)
        check_lora_request(req)
        if req.suffix is not None:
            raise APIError("suffix is not supported: omit it", param="suffix")
        structured, param = structured_outputs_of(req)
        prompt_logprobs = req.logprobs if (req.echo and req.logprobs is not None) else None
        params = sampling_params_of(
            req,
            req.max_tokens,
            req.logprobs,
            vocab_size=self.engine.vocab_size,
            structured=structured,
            prompt_logprobs=prompt_logprobs,
        )
        await self._compile(structured, param)
        raw_prompts = _completion_prompts(req.prompt)
        # NOTE: every prompt is checked before any starts, so a bad one rejects the whole request.
        prompts = [await self.preprocessor.encode(p) for p in raw_prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        self._log_user(request_id, req)
        streams = await self._start(
            request_id, prompts, params, req.priority, cache_salt, owner, lora
        )
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in raw_prompts]
        builder = responses.CompletionBuilder(
            request_id, req.model, self.tokenizer, params, len(prompts), echo=echo
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(builder, streams, include_usage)
        finals = await collect_finals(streams)
        return builder.full(finals, usage_of(finals)).model_dump()

    # ---- chat -------------------------------------------------------------------------------

    async def create_chat_completion(
        self, req: ChatCompletionRequest, cache_salt: str | None, owner: str | None = None
    ) -> AsyncIterator[str] | dict:
        """A chat completion body, or an iterator of server-sent events when streaming."""
        lora = self.check_model(req.model, owner)
        template_kwargs = check_chat_fields(req, self.reasoning_parser is not None)
        native = template_supports_tools(self.tokenizer.chat_template)
        # NOTE: a template without tool support gets the generic (Hermes-format) tool prompt,
        # so its replies are read with the Hermes parser unless the server names another.
        tool_parser = self.tool_parser or (None if native else HermesToolParser())
        mode = chat_tools.tool_mode(
            req, auto_enabled=self.enable_auto_tool_choice, has_parser=tool_parser is not None
        )
        structured, param = structured_outputs_of(req)
        tool_schema = None if mode is None else chat_tools.constraint_schema(req, mode)
        if tool_schema is not None:
            if structured is not None:
                raise APIError(
                    f"tool_choice {mode.kind!r} constrains the output; {param} cannot also be set",
                    param=param,
                )
            structured, param = StructuredOutputsParams(json=tool_schema), "tools"
        if structured is not None and self.reasoning_parser is not None:
            # NOTE: the constraint applies after the think block (reasoning_grammar.py).
            try:
                structured = await self.preprocessor.run(
                    after_reasoning, structured, self.reasoning_parser.name
                )
            except InvalidStructuredOutputsError as exc:
                raise APIError(str(exc), param=param) from None
        # NOTE: None (not max_model_len) when the client sets no limit: the engine admits the
        # request on its prompt and caps it by the context and the pool.
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params_of(
            req, max_tokens, logprobs, vocab_size=self.engine.vocab_size, structured=structured
        )
        await self._compile(structured, param)
        tools = None
        if mode is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        messages = chat_tools.template_messages(req.messages, tools, native)
        prompt = await self.preprocessor.render_chat(
            messages, self.model_name, tools if native else None, template_kwargs
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        self._log_user(request_id, req)
        streams = await self._start(
            request_id, [prompt], params, req.priority, cache_salt, owner, lora
        )
        make_parser = None
        if mode is not None or self.reasoning_parser is not None:

            def make_parser() -> ChatOutputParser:
                return ChatOutputParser(self.reasoning_parser, tool_parser, mode)

        builder = responses.ChatBuilder(
            request_id, req.model, self.tokenizer, params, make_parser=make_parser
        )
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._stream(builder, streams, include_usage)
        finals = await collect_finals(streams)
        return builder.full(finals, usage_of(finals)).model_dump()

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
                hop = _hop_line(out) if self.trace_hops else ""
                for chunk in builder.chunks(i, out):
                    yield f"{hop}data: {chunk.model_dump_json()}\n\n"
                if out.finished:
                    finals[i] = out
            if include_usage:
                usage = usage_of([finals[i] for i in sorted(finals)])
                yield f"data: {builder.usage_chunk(usage).model_dump_json()}\n\n"
        except (InvalidRequestError, ValueError, RequestFailedError, EngineDeadError) as exc:
            yield f"data: {responses.error_json(exc)}\n\n"
        except Exception as exc:
            logger.exception("streamed request %s failed", builder.request_id)
            yield f"data: {responses.error_json(RuntimeError(f'internal error: {exc!r}'))}\n\n"
        yield "data: [DONE]\n\n"


def _hop_line(out: RequestOutput) -> str:
    """': hop e=<engine made the token> r=<this loop read it>' (time.monotonic())."""
    made = getattr(out.metrics, "last_token_time", None) if out.metrics else None
    return f": hop e={made or 0.0:.6f} r={time.monotonic():.6f}\n"


async def collect_finals(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run every stream to its end; the final output of each, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge_streams(streams):
        if out.finished:
            finals[i] = out
    return [finals[i] for i in sorted(finals)]


def _completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a completion request (already type-checked by the protocol)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)
