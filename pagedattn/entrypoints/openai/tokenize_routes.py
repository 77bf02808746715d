"""`/tokenize` and `/detokenize` with vLLM's request and response shapes.

- ``POST /tokenize`` ``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "tools": [...]}`` (rendered as /v1/chat/completions renders it),
  with ``"return_token_strs": true`` for the token strings ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``.
- ``POST /detokenize`` ``{"tokens": [ids]}`` -> ``{"prompt": str}``.

`model` is optional (as in vLLM); when sent it must name the served model or an adapter. Work runs
on the tokeniser pool with the same caps as a completion prompt: a text longer than the prompt
cap, or of max_model_len tokens or more, is a 400.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, StrictBool

from pagedattn.chat_template import template_supports_tools
from pagedattn.entrypoints.openai import chat_tools
from pagedattn.entrypoints.openai.protocol import ChatMessage
from pagedattn.entrypoints.openai.protocol_base import APIError, OpenAIBaseModel, Text, TokenId
from pagedattn.entrypoints.openai.tool_protocol import ChatTool, check_tools

if TYPE_CHECKING:
    from pagedattn.entrypoints.openai.serving import OpenAIServing


class TokenizeRequest(OpenAIBaseModel):
    """Body of ``POST /tokenize``: a prompt, or chat messages (exactly one)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False


class TokenizeResponse(BaseModel):
    """vLLM's tokenize response."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """Body of ``POST /detokenize``."""

    model: Text | None = None
    tokens: list[TokenId] = Field(min_length=1)


class DetokenizeResponse(BaseModel):
    """vLLM's detokenize response."""

    prompt: str


async def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> dict:
    """The token ids (and strings) of a prompt or a rendered chat."""
    if req.model is not None:
        serving.check_model(req.model)
    pre = serving.preprocessor
    if (req.prompt is None) == (req.messages is None):
        raise APIError("send exactly one of prompt and messages", param="prompt")
    if req.prompt is not None:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        if not req.prompt:
            ids: list[int] = []
        else:
            pre._check_chars(len(req.prompt), "prompt")
            ids = await pre.run(pre._encode, req.prompt, add_special, num_chars=len(req.prompt))
            pre._check_tokens(ids, "prompt")
    else:
        if req.add_special_tokens:
            raise APIError(
                "add_special_tokens applies to a prompt; a chat template adds its own",
                param="add_special_tokens",
            )
        tools = None
        if req.tools:
            check_tools(req.tools, None)
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        native = template_supports_tools(getattr(serving.tokenizer, "chat_template", None))
        messages = chat_tools.template_messages(req.messages, tools, native)
        ids = await pre.render_chat(
            messages,
            serving.model_name,
            tools if native else None,
            req.chat_template_kwargs,
            add_generation_prompt=req.add_generation_prompt,
        )
    strs = None
    if req.return_token_strs:
        strs = await pre.run(pre.local_tokenizer().convert_ids_to_tokens, ids, num_chars=len(ids))
    body = TokenizeResponse(
        count=len(ids), max_model_len=serving.engine.max_model_len, tokens=ids, token_strs=strs
    )
    return body.model_dump()


async def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> dict:
    """The text of token ids."""
    if req.model is not None:
        serving.check_model(req.model)
    vocab_size = serving.engine.vocab_size
    bad = sorted({t for t in req.tokens if t >= vocab_size})
    if bad:
        raise APIError(
            f"tokens {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="tokens"
        )
    max_len = serving.engine.max_model_len
    if len(req.tokens) > max_len:
        raise APIError(
            f"{len(req.tokens)} tokens is more than max_model_len ({max_len})", param="tokens"
        )
    pre = serving.preprocessor
    text = await pre.run(
        lambda ids: pre.local_tokenizer().decode(ids), req.tokens, num_chars=len(req.tokens)
    )
    return DetokenizeResponse(prompt=text).model_dump()
