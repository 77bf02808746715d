"""Base types of the OpenAI API bodies: validated strings and numbers, the request base model,
and the error shape (an exception carrying an HTTP status, and the `{"error": ...}` body)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt


def _valid_utf8(value: str) -> str:
    """Reject strings that cannot be encoded as UTF-8 (JSON escapes of lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start : exc.end].encode("unicode_escape").decode()
        raise ValueError(
            f"contains '{bad}' at index {exc.start}, which is not valid Unicode text "
            "(a lone UTF-16 surrogate); send valid UTF-8"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_utf8)]
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenId = Annotated[StrictInt, Field(ge=0)]


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


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-style error body as a plain dict."""
    info = ErrorInfo(message=message, type=err_type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()
