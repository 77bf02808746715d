"""Request and response bodies of the OpenAI-compatible API (pydantic models)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI caps completions `logprobs` at 5 and chat `top_logprobs` at 20; the engine allows 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_N = 16


class OpenAIBaseModel(BaseModel):
    """Base of every request model: unknown fields are ignored, as the OpenAI API does."""

    model_config = ConfigDict(extra="ignore")


class ErrorInfo(BaseModel):
    """The `error` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    """Streaming options; `include_usage` adds a final chunk that carries token counts."""

    include_usage: bool = False


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completion and chat requests."""

    model: str
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # Extensions (vLLM names).
    top_k: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: int = 0


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextContentPart(OpenAIBaseModel):
    """A text part of a multi-part chat message."""

    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None

    def text(self) -> str:
        """The content as plain text (multi-part text is joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class PromptTokensDetails(BaseModel):
    """Prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    """Logprobs of a completion choice, in the legacy completions format."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion (whole, or a streamed delta)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Body of a completion response, and of each streamed chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """One alternative token at a position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The sampled token at a position and its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    """Logprobs of a chat choice."""

    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a chat choice (or a streamed delta of it)."""

    role: str | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Body of a non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedattn"
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error body as a plain dict."""
    info = ErrorInfo(message=message, type=err_type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()
