"""Requests in: prompts to token ids, chat templates, and the checks made before admission."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedattn.core.stop import SEED_LIMIT
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.sampling_params import SamplingParams


class InputProcessor:
    """Turns a user's prompt (text or token ids) into checked token ids for the scheduler."""

    def __init__(self, tokenizer, vocab_size: int, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model_name

    def process(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        max_tokens_that_fit: Callable[[int], int],
        limits: str,
    ) -> tuple[list[int], int]:
        """The prompt's token ids and the request's output-token cap, or InvalidRequestError.

        ``max_tokens_that_fit(num_prompt_tokens)`` is what the context and the KV pool allow;
        ``limits`` names them in the message. Without max_tokens a request may generate that
        much, so a short request is never rejected for a whole context's worth of blocks.
        """
        if params.seed is not None and not 0 <= params.seed < SEED_LIMIT:
            raise InvalidRequestError(
                f"seed={params.seed} is out of range: use an integer in [0, 2**63)", "seed"
            )
        self.check_token_ids(params)
        prompt_ids = self.tokenize(prompt)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token", "prompt")
        num_prompt = len(prompt_ids)
        room = max_tokens_that_fit(num_prompt)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens: with one generated token that is more than "
                f"{limits} hold; shorten the prompt",
                param="prompt",
            )
        return prompt_ids, room if params.max_tokens is None else params.max_tokens

    def check_token_ids(self, params: SamplingParams) -> None:
        """Every token id the params name (logit_bias keys, stop_token_ids) is in the vocabulary."""
        for param, token_ids in (
            ("logit_bias", (params.logit_bias or {}).keys()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                shown = ", ".join(str(t) for t in bad[:3]) + (", ..." if len(bad) > 3 else "")
                raise InvalidRequestError(
                    f"{param} names token id(s) {shown} outside the vocabulary of "
                    f"{self.model_name}: use ids in [0, {self.vocab_size})",
                    param=param,
                )

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (with the BOS the tokenizer adds), or checked given ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty: send at least one token", "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not isinstance(prompt, list | tuple) or not all(
            type(t) is int and 0 <= t < self.vocab_size for t in prompt
        ):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {self.vocab_size})", param="prompt"
            )
        return list(prompt)

    def apply_chat_template(
        self, messages: Iterable[dict], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as the model's chat template renders it (special tokens included)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(f"model {self.model_name} has no chat template")
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
