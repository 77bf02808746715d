"""An OpenAI request's engine-side parameters: its SamplingParams and its output constraint."""

from __future__ import annotations

from pagedattn.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from pagedattn.sampling_params import SamplingParams
from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)

_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def structured_outputs_of(
    req: CompletionRequest | ChatCompletionRequest,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that set it (for error messages)."""
    given: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        given.append(("response_format", {"json": fmt.json_schema.schema_}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        spec = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": bool(so.json_object),
        }
        given.append(("structured_outputs", {k: v for k, v in spec.items() if v}))
    for name in _GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            given.append((name, {name.removeprefix("guided_"): value}))
    if not given:
        return None, None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise APIError(f"send one output constraint, not several ({names})", param=given[1][0])
    param, spec = given[0]
    try:
        return StructuredOutputsParams(**spec), param
    except InvalidStructuredOutputsError as exc:
        raise APIError(str(exc), param=param) from None


def _logit_bias(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> dict | None:
    if not req.logit_bias:
        return None
    bias = {int(token): value for token, value in req.logit_bias.items()}
    bad = sorted(t for t in bias if t >= vocab_size)
    if bad:
        raise APIError(
            f"logit_bias names token ids {bad[:5]} outside the vocabulary [0, {vocab_size})",
            param="logit_bias",
        )
    return bias


def sampling_params_of(
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
    *,
    vocab_size: int,
    structured: StructuredOutputsParams | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's SamplingParams of a completion or chat request (400 for what cannot be)."""
    if req.best_of is not None and req.best_of > req.n and req.stream:
        raise APIError("best_of > n cannot be streamed: set stream=false", param="best_of")
    optional = {}
    if req.min_p is not None:
        optional["min_p"] = req.min_p
    if req.repetition_penalty is not None:
        optional["repetition_penalty"] = req.repetition_penalty
    return SamplingParams(
        n=req.n,
        best_of=req.best_of,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        ignore_eos=req.ignore_eos,
        logit_bias=_logit_bias(req, vocab_size),
        structured_outputs=structured,
        **optional,
    )
