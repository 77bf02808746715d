"""OpenAI fields this server does not honour get a 400 naming the field, never a silent 200.

- `top_logprobs` without `logprobs: true`: 400 (OpenAI's rule).
- Legacy `functions` / `function_call`: 400, pointing to `tools` / `tool_choice`.
- `modalities` other than ["text"], `audio`, `prediction`: 400 (text out only, no predicted
  outputs).
- `reasoning_effort`: honoured with `--reasoning-parser` (handed to the chat template, which may
  read it; "none" also turns Qwen3's thinking off through `enable_thinking`), else 400.
- vLLM's `lora_request` body field: 400; an adapter is chosen by naming it in `model`.
- Unknown fields (not in the API): accepted, as vLLM does, named in a warning log line and in the
  `x-ignored-fields` response header.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from pagedattn.entrypoints.openai.protocol_base import APIError

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-ignored-fields"
MAX_HEADER_CHARS = 1024
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


def _refuse(param: str, why: str) -> APIError:
    return APIError(f"{param} is not supported by this server: {why}", param=param)


def check_chat_fields(req: Any, reasoning_enabled: bool) -> dict[str, Any]:
    """Raise a 400 for a defined field the server does not honour; the template kwargs to add."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.functions is not None:
        raise _refuse("functions", "send the functions as `tools` (the legacy field is gone)")
    if req.function_call is not None:
        raise _refuse("function_call", "use `tool_choice` with `tools`")
    if req.modalities is not None and list(req.modalities) != ["text"]:
        raise _refuse("modalities", 'this server generates text only: omit it or send ["text"]')
    if req.audio is not None:
        raise _refuse("audio", "this server generates text only")
    if req.prediction is not None:
        raise _refuse("prediction", "predicted outputs are not implemented: omit it")
    check_lora_request(req)
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    effort = req.reasoning_effort
    if effort is not None:
        if not reasoning_enabled:
            raise _refuse(
                "reasoning_effort",
                "start the server with --reasoning-parser for a reasoning model, or omit it",
            )
        if effort not in REASONING_EFFORTS:
            raise APIError(
                f"reasoning_effort={effort!r} is invalid: use one of {list(REASONING_EFFORTS)}",
                param="reasoning_effort",
            )
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def check_lora_request(req: Any) -> None:
    """vLLM's `lora_request` field: refused (an adapter is named in `model`)."""
    if getattr(req, "lora_request", None) is not None:
        raise _refuse(
            "lora_request",
            "name a loaded adapter in `model` instead (GET /v1/models lists them)",
        )


def ignored_fields(body: BaseModel) -> list[str]:
    """The request's fields that are not in the API (kept by `extra="allow"`), logged once."""
    extra = sorted(getattr(body, "model_extra", None) or {})
    if extra:
        logger.warning("the request's fields %s are not in the API and were ignored", extra)
    return extra


def ignored_header(fields: list[str]) -> dict[str, str]:
    """The response header naming ignored fields (empty when none)."""
    if not fields:
        return {}
    # NOTE: header values are latin-1; a field name is the client's text, so escape and cap it.
    names = ",".join(f.encode("ascii", "backslashreplace").decode() for f in fields)
    return {IGNORED_FIELDS_HEADER: names[:MAX_HEADER_CHARS]}
