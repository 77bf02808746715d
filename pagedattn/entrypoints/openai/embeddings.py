"""``POST /v1/embeddings``: the served model's pooled final hidden states (engine/embedding.py).

Input: a string, a list of strings, a list of token ids, or a list of lists of token ids (at
most MAX_PROMPTS_PER_REQUEST inputs, each checked like a completion prompt). Every input is its
own engine request, all added at once, so the scheduler batches them with whatever else runs.
`encoding_format` "float" (lists) or "base64" (little-endian float32 bytes, as OpenAI sends
them); `dimensions` keeps the first N values before normalising (meaningful for models trained
Matryoshka-style; any model accepts it, up to its hidden size). Extensions (vLLM-style):
`pooling` ("last", the default, or "mean") and `normalize` (default true).
"""

from __future__ import annotations

import base64
import struct
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from pagedattn.engine.embedding import (
    embedding_params,
    embedding_salt,
    finish_embedding,
    pooled_of,
)
from pagedattn.entrypoints.openai.protocol import _check_prompt
from pagedattn.entrypoints.openai.protocol_base import APIError, OpenAIBaseModel, Text
from pagedattn.entrypoints.openai.request_checks import check_lora_request
from pagedattn.entrypoints.openai.serving import OpenAIServing, collect_finals


class EmbeddingRequest(OpenAIBaseModel):
    """Body of ``POST /v1/embeddings``."""

    model_config = ConfigDict(extra="allow")

    model: Text
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: Text | None = None
    pooling: Literal["last", "mean"] = "last"
    normalize: StrictBool = True
    cache_salt: Text | None = Field(default=None, min_length=1)
    priority: StrictInt = 0
    lora_request: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        if value == "":
            raise ValueError("the input is empty: send at least one token")
        return _check_prompt(value)


class EmbeddingData(BaseModel):
    """One input's embedding."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Token counts of an embeddings request."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """Body of an embeddings response."""

    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _inputs(value: str | list) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def create_embedding(
    serving: OpenAIServing, req: EmbeddingRequest, cache_salt: str | None, owner: str | None
) -> dict:
    """The embeddings of every input, in input order."""
    lora = serving.check_model(req.model)
    check_lora_request(req)
    prompts = [await serving.preprocessor.encode(p, "input") for p in _inputs(req.input)]
    params = embedding_params(req.pooling)
    request_id = f"embd-{uuid.uuid4().hex}"
    if req.user is not None:
        serving._log_user(request_id, req)
    streams = []
    try:
        for i, prompt in enumerate(prompts):
            streams.append(
                await serving.engine.add_request(
                    f"{request_id}-{i}",
                    prompt,
                    params,
                    priority=req.priority,
                    cache_salt=embedding_salt(req.pooling, cache_salt),
                    owner=owner,
                    lora_request=lora,
                )
            )
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    finals = await collect_finals(streams)
    data = []
    for i, out in enumerate(finals):
        try:
            vector = finish_embedding(
                pooled_of(out), normalize=req.normalize, dimensions=req.dimensions
            )
        except ValueError as exc:
            raise APIError(str(exc), param="dimensions") from None
        data.append(EmbeddingData(index=i, embedding=_encode(vector, req.encoding_format)))
    num_tokens = sum(len(p) for p in prompts)
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return EmbeddingResponse(data=data, model=req.model, usage=usage).model_dump()
