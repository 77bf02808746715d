"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Validation happens here, once, at the API boundary: strict types (a JSON `true` is not the
integer 1, a number is not a string), finite floats, seeds in [0, 2**63), strings that are valid
UTF-8 (no lone surrogates), and the server's limits (n, stop strings, logit_bias). Errors become
OpenAI error bodies with `param` naming the field (server.py).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from pagedattn.entrypoints.openai.protocol_base import (  # noqa: F401 (re-exported)
    APIError,
    ErrorInfo,
    ErrorResponse,
    FiniteFloat,
    OpenAIBaseModel,
    Text,
    TokenId,
    _valid_utf8,
    error_body,
)
from pagedattn.entrypoints.openai.tool_protocol import (
    ChatTool,
    DeltaToolCall,
    ToolCall,
    ToolCallOut,
    ToolChoice,
)

# OpenAI caps completions `logprobs` at 5 and chat `top_logprobs` at 20; the engine allows 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_NUM_STOP = 16
MAX_STOP_CHARS = 256
# Prompts in one completion request (a list of strings or of token-id lists); each is a request
# to the engine, so a batch of thousands would hold the server for minutes.
MAX_PROMPTS_PER_REQUEST = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
# Seeds seed a torch.Generator (a signed 64-bit value).
MAX_SEED = 2**63


class StreamOptions(OpenAIBaseModel):
    """Streaming options; `include_usage` adds a final chunk that carries token counts."""

    include_usage: StrictBool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """The `json_schema` member of `response_format`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Text = "response"
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.schema_ is None
        ):
            raise ValueError("type 'json_schema' needs json_schema.schema (a JSON schema object)")
        return self


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(default=None, min_length=1)
    grammar: Text | None = None
    json_object: StrictBool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


def _check_prompt(value: Any) -> Any:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""

    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v
        )

    if isinstance(value, str):
        return _valid_utf8(value)
    if isinstance(value, list):
        if not value:
            raise ValueError("the prompt is empty: send at least one token")
        if is_ids(value):
            return value
        if len(value) > MAX_PROMPTS_PER_REQUEST and all(isinstance(p, str | list) for p in value):
            raise ValueError(
                f"{len(value)} prompts in one request is more than this server accepts "
                f"({MAX_PROMPTS_PER_REQUEST}): send them in several requests"
            )
        if all(isinstance(p, str) for p in value):
            return [_valid_utf8(p) for p in value]
        if all(is_ids(p) for p in value):
            return value
    raise ValueError(
        "must be a string, a list of strings, a list of token ids (integers >= 0) "
        "or a list of lists of token ids"
    )


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completion and chat requests.

    Unknown fields are kept (`model_extra`), so the server can name them in a warning log line
    and an `x-ignored-fields` response header (vLLM's behaviour) instead of dropping them unsaid.
    """

    model_config = ConfigDict(extra="allow")

    model: Text
    temperature: FiniteFloat | None = Field(default=None, ge=0)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    seed: StrictInt | None = Field(default=None, ge=0, lt=MAX_SEED)
    presence_penalty: FiniteFloat = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: FiniteFloat = Field(default=0.0, ge=-2, le=2)
    # Token id (a JSON object key, so a string) -> bias added to its logit, in [-100, 100].
    logit_bias: dict[str, FiniteFloat] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS_ENTRIES
    )
    # Accepted and logged at debug level; never changes the output.
    user: Text | None = None
    response_format: ResponseFormat | None = None
    # Extensions (vLLM names).
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: FiniteFloat | None = Field(default=None, ge=0, le=1)
    repetition_penalty: FiniteFloat | None = Field(default=None, gt=0)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    cache_salt: Text | None = Field(default=None, min_length=1)
    priority: StrictInt = 0
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(default=None, min_length=1)
    guided_grammar: Text | None = None
    # vLLM's field: refused with a 400 (an adapter is named in `model`), never ignored.
    lora_request: Any = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_NUM_STOP:
            raise ValueError(f"at most {MAX_NUM_STOP} stop strings are allowed, got {len(stops)}")
        for s in stops:
            if not s:
                raise ValueError("stop strings must be non-empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit() or not key.isascii():
                raise ValueError(f"key {key!r} is not a token id: use non-negative integers")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias {bias} of token {key} is out of range: use [-100, 100]")
        return value


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: Any
    max_tokens: StrictInt | None = Field(default=16, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _check_prompt(value)


class TextContentPart(OpenAIBaseModel):
    """A text part of a multi-part chat message."""

    type: Literal["text"]
    text: Text


class ChatMessage(OpenAIBaseModel):
    """One message of a conversation (an assistant's may carry tool calls, a tool's a result)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs tool_call_id (the call it answers)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role!r} ones")
        return self

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
    # None: as many tokens as the context and the KV pool allow (the engine caps it).
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    # vLLM's: extra variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI fields this server refuses with a 400 naming them (request_checks.py), or honours
    # (reasoning_effort, with --reasoning-parser).
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Text | None = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None


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
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatDeltaMessage(BaseModel):
    """A streamed delta of the assistant message."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
    delta: ChatDeltaMessage
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
    # vLLM's fields: the folder (always None here: no server path is shown) and an adapter's
    # base model (None for the base model).
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    """Body of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
