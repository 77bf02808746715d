"""PromptPreprocessor: tokenisation and chat templating in a worker pool, with size limits.

A long prompt must not stall other requests: encoding runs neither on the event loop (which
streams every response) nor on the engine thread (which steps every request), but on a small
thread pool. Each worker has its own copy of the tokenizer (a Rust tokenizer shared across
threads can fail with "Already borrowed"). Size limits are checked before any work is done.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedattn.engine.errors import InvalidRequestError

DEFAULT_NUM_WORKERS = 2
# Used when the tokenizer's vocabulary cannot be listed.
FALLBACK_MAX_CHARS_PER_TOKEN = 64


def max_chars_per_token(tokenizer) -> int:
    """The longest token's text: a prompt of more than max_model_len times this cannot fit."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return FALLBACK_MAX_CHARS_PER_TOKEN
    # NOTE: byte-level BPE spells each byte as one character, so this bounds the UTF-8 length.
    return max((len(token) for token in vocab), default=FALLBACK_MAX_CHARS_PER_TOKEN) or 1


class PromptPreprocessor:
    """Encodes prompts and renders chats off the event loop and off the engine thread."""

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        *,
        max_prompt_chars: int | None = None,
        num_workers: int = DEFAULT_NUM_WORKERS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        if max_prompt_chars is None:
            max_prompt_chars = max_model_len * max_chars_per_token(tokenizer)
        self.max_prompt_chars = max_prompt_chars
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="pagedattn-tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def local_tokenizer(self):
        """This thread's own copy of the tokenizer."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            try:
                tok = copy.deepcopy(self.tokenizer)
            except Exception:
                tok = self.tokenizer
            self._local.tokenizer = tok
        return tok

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"the prompt has {num_chars} characters, more than this server accepts "
                f"({self.max_prompt_chars}, the most that could fit in max_model_len "
                f"{self.max_model_len} tokens); shorten it",
                param=param,
            )

    def _check_tokens(self, ids: Sequence[int], param: str) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty: send at least one token", param)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but the model's max_model_len is "
                f"{self.max_model_len} (prompt plus at least one new token); shorten it",
                param=param,
            )
        return list(ids)

    def _encode(self, prompt: str) -> list[int]:
        return list(self.local_tokenizer().encode(prompt, add_special_tokens=True))

    async def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Token ids of a text or token-id prompt; raises InvalidRequestError if it cannot fit."""
        if isinstance(prompt, list):
            return self._check_tokens(prompt, param)
        if not prompt:
            raise InvalidRequestError("the prompt is empty: send at least one token", param)
        self._check_chars(len(prompt), param)
        return self._check_tokens(await self.run(self._encode, prompt), param)

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self.local_tokenizer()
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # NOTE: the template already holds any BOS token; do not add special tokens again.
        return list(tok.encode(text, add_special_tokens=False))

    async def render_chat(self, messages: list[dict[str, str]], model_name: str) -> list[int]:
        """Token ids of a chat rendered with the model's template."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"model {model_name} has no chat template: use /v1/completions", param="messages"
            )
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        return self._check_tokens(await self.run(self._render, messages), "messages")
