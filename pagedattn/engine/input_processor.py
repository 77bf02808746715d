"""Requests in: prompts to token ids, chat templates, and the checks made before admission."""

from __future__ import annotations

from collections.abc import Iterable

from pagedattn.engine.errors import InvalidRequestError


class InputProcessor:
    """Turns a user's prompt (text or token ids) into checked token ids for the scheduler."""

    def __init__(self, tokenizer, vocab_size: int, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.model_name = model_name

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
