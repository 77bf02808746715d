"""Per-request decoding parameters: SamplingParams and BeamSearchParams, as in vLLM."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pagedattn.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as 0 (greedy), as in vLLM.
SAMPLING_EPS = 1e-5
MAX_NUM_LOGPROBS = 20
MIN_PENALTY = -2.0
MAX_PENALTY = 2.0
# Values of `top_k` that OpenAI-style clients send to mean "no top-k"; normalised to None.
TOP_K_DISABLED_VALUES = (0, -1)
# Seeds seed a torch.Generator, a signed 64-bit value.
MAX_SEED = 2**63
MAX_LOGIT_BIAS = 100.0
# n and best_of: the sequences of one request (OpenAI's cap on n). Every sibling holds its own
# blocks and state, and the engine also refuses more than its max_num_seqs.
MAX_NUM_SEQS_PER_REQUEST = 128


_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)


class InvalidSamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and what is allowed."""


class SamplingType(enum.IntEnum):
    """How the sampler picks a request's next token."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidSamplingParamsError(message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request: sampling knobs, penalties, stop conditions and output options."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    # None: no top-k. 0 and -1 (OpenAI-client conventions) are accepted and become None.
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # None: up to the model's context length; the engine resolves it per request.
    max_tokens: int | None = 16
    min_tokens: int = 0
    # None: no logprobs; k: the sampled token's logprob plus the k most likely tokens'.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # Token id -> bias added to its logit before sampling, in [-100, 100] (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    # None: no prompt logprobs; k: each prompt token's logprob plus the k most likely tokens'.
    prompt_logprobs: int | None = None
    # The output must match this (JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # "last" or "mean": also hand back the prompt's final hidden states pooled (an embedding,
    # RequestOutput.extra["pooled"]); None: not a pooling request.
    pooling: str | None = None

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()
        self._reset_greedy()

    def _normalise(self) -> None:
        # NOTE: frozen dataclass; normalisation writes through object.__setattr__ once, here.
        set_ = object.__setattr__
        if self.stop is None:
            set_(self, "stop", [])
        elif isinstance(self.stop, str):
            set_(self, "stop", [self.stop])
        else:
            _require(
                isinstance(self.stop, list | tuple),
                f"stop={self.stop!r} is invalid: use a string or a list of non-empty strings",
            )
            set_(self, "stop", list(self.stop))
        _require(
            self.stop_token_ids is None or isinstance(self.stop_token_ids, list | tuple),
            f"stop_token_ids={self.stop_token_ids!r} is invalid: use a list of token ids",
        )
        set_(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.logit_bias is not None:
            _require(
                isinstance(self.logit_bias, dict),
                f"logit_bias={self.logit_bias!r} is invalid: use a dict token id -> bias",
            )
            set_(self, "logit_bias", dict(self.logit_bias))
        if self.top_k in TOP_K_DISABLED_VALUES:
            set_(self, "top_k", None)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _require(
                isinstance(value, int | float) and not isinstance(value, bool),
                f"{name}={value!r} is invalid: use a number",
            )
            _require(math.isfinite(value), f"{name}={value!r} is invalid: use a finite number")
            set_(self, name, float(value))

    def _reset_greedy(self) -> None:
        # NOTE: after validation, so that an out-of-range value is an error even when greedy.
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change argmax, so reset them (as vLLM does).
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", None)
            object.__setattr__(self, "min_p", 0.0)

    def _validate(self) -> None:
        _require(
            _is_int(self.n) and 1 <= self.n <= MAX_NUM_SEQS_PER_REQUEST,
            f"n={self.n!r} is invalid: use an integer in [1, {MAX_NUM_SEQS_PER_REQUEST}]",
        )
        _require(
            self.best_of is None
            or (_is_int(self.best_of) and self.n <= self.best_of <= MAX_NUM_SEQS_PER_REQUEST),
            f"best_of={self.best_of!r} is invalid: use None or an integer in [n ({self.n}), "
            f"{MAX_NUM_SEQS_PER_REQUEST}]",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                MIN_PENALTY <= value <= MAX_PENALTY,
                f"{name}={value!r} is invalid: use a number in [{MIN_PENALTY}, {MAX_PENALTY}]",
            )
        _require(
            self.repetition_penalty > 0,
            f"repetition_penalty={self.repetition_penalty!r} is invalid: use a number > 0 "
            "(1.0 = off)",
        )
        _require(
            self.temperature >= 0,
            f"temperature={self.temperature!r} is invalid: use a number >= 0 (0 = greedy)",
        )
        _require(0 < self.top_p <= 1, f"top_p={self.top_p!r} is invalid: use a number in (0, 1]")
        _require(
            self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
            f"top_k={self.top_k!r} is invalid: use an integer >= 1, or None/0/-1 to disable",
        )
        _require(0 <= self.min_p <= 1, f"min_p={self.min_p!r} is invalid: use a number in [0, 1]")
        _require(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED),
            f"seed={self.seed!r} is invalid: use an integer in [0, 2**63) or None",
        )
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens={self.max_tokens!r} is invalid: use an integer >= 1 or None",
        )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens={self.min_tokens!r} is invalid: use an integer >= 0",
        )
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens={self.min_tokens} is invalid: it must be <= max_tokens "
            f"({self.max_tokens})",
        )
        _require(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_NUM_LOGPROBS),
            f"logprobs={self.logprobs!r} is invalid: use None or an integer in "
            f"[0, {MAX_NUM_LOGPROBS}]",
        )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop={self.stop!r} is invalid: use non-empty strings",
        )
        _require(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids={self.stop_token_ids!r} is invalid: use non-negative token ids",
        )
        _require(
            self.pooling in (None, "last", "mean"),
            f"pooling={self.pooling!r} is invalid: use None, 'last' or 'mean'",
        )
        _require(
            self.prompt_logprobs is None
            or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_NUM_LOGPROBS),
            f"prompt_logprobs={self.prompt_logprobs!r} is invalid: use None or an integer in "
            f"[0, {MAX_NUM_LOGPROBS}]",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _require(
                _is_int(token_id) and token_id >= 0,
                f"logit_bias={{{token_id!r}: ...}} is invalid: keys are token ids (integers >= 0)",
            )
            _require(
                isinstance(bias, int | float)
                and not isinstance(bias, bool)
                and math.isfinite(bias)
                and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                f"logit_bias={{{token_id}: {bias!r}}} is invalid: biases are numbers in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        _require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            f"structured_outputs={self.structured_outputs!r} is invalid: use a "
            "StructuredOutputsParams",
        )
        _require(
            self.detokenize or not self.stop,
            "stop strings need detokenize=True: set detokenize=True or use stop_token_ids",
        )

    @classmethod
    def for_beam_step(cls, beam_width: int, max_tokens: int) -> SamplingParams:
        """Each beam's params in beam search: greedy, no EOS stop, its 2 * beam_width best tokens.

        NOTE: the one place logprobs may pass MAX_NUM_LOGPROBS (the cap on what a client asks
        for): the search ranks that many candidates per beam, and the engine bounds beam_width
        by max_num_seqs (every beam runs every step).
        """
        params = cls(
            temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False
        )
        object.__setattr__(params, "logprobs", 2 * beam_width)
        return params

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """Greedy, random, or random with a per-request seed."""
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        """True when any of the presence, frequency or repetition penalties is active."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def output_text_buffer_length(self) -> int:
        """Characters to hold back while streaming so a partial stop string is never sent."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search: keep the `beam_width` best sequences by length-penalised log probability."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _require(
            _is_int(self.beam_width) and self.beam_width >= 1,
            f"beam_width={self.beam_width!r} is invalid: use an integer >= 1",
        )
        _require(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            f"max_tokens={self.max_tokens!r} is invalid: use an integer >= 1",
        )
        _require(
            self.temperature >= 0,
            f"temperature={self.temperature!r} is invalid: use a number >= 0 (0 = greedy)",
        )
