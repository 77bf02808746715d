"""PromptPreprocessor: tokenisation and chat templating in worker pools, with size limits.

A long prompt must not stall other requests: encoding runs neither on the event loop (which
streams every response) nor on the engine thread (which steps every request), but on small
thread pools: one lane for short prompts, one for long ones, so a short request never waits
behind another tenant's long tokenisation. Each worker has its own copy of the tokenizer (a Rust
tokenizer shared across threads can fail with "Already borrowed"). Size limits are checked before
any work is done, and a prompt is encoded in growing prefixes, so one far past max_model_len is
refused after encoding about max_model_len tokens, not all of it.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pagedattn.engine.errors import InvalidRequestError
from pagedattn.entrypoints.openai.control_tokens import control_texts, encode_shielded, shield
from pagedattn.entrypoints.openai.worker_pool import WorkerPool

DEFAULT_NUM_WORKERS = 2
# Prompts up to this many characters are encoded on their own lane (one worker).
SMALL_PROMPT_CHARS = 8192
# Used when the tokenizer's vocabulary cannot be listed.
FALLBACK_MAX_CHARS_PER_TOKEN = 64
# The default character cap is max_model_len times this (or the longest token, if shorter):
# English averages about 4 characters a token, so twice that leaves room for code and spaces
# while a prompt far past what fits is refused before any tokenisation.
DEFAULT_CHARS_PER_TOKEN = 8
# The first prefix encoded is max_model_len times this many characters; each next one doubles.
PROBE_CHARS_PER_TOKEN = 4


def max_chars_per_token(tokenizer) -> int:
    """The longest token's text: a prompt of more than max_model_len times this cannot fit."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return FALLBACK_MAX_CHARS_PER_TOKEN
    # NOTE: byte-level BPE spells each byte as one character, so this bounds the UTF-8 length.
    return max((len(token) for token in vocab), default=FALLBACK_MAX_CHARS_PER_TOKEN) or 1


def default_max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """The default `--max-prompt-chars`: near the most characters that can fit in the context."""
    return max_model_len * min(DEFAULT_CHARS_PER_TOKEN, max_chars_per_token(tokenizer))


def check_prompt_chars(num_chars: int, max_chars: int, max_model_len: int, param: str) -> None:
    """Raise InvalidRequestError if a prompt of `num_chars` characters is over the cap."""
    if num_chars > max_chars:
        raise InvalidRequestError(
            f"the prompt has {num_chars} characters, more than this server accepts "
            f"({max_chars}, for max_model_len {max_model_len} tokens; --max-prompt-chars sets "
            "it); shorten it",
            param=param,
        )


def encode_bounded(encode: Callable[[str], list[int]], text: str, max_tokens: int) -> list[int]:
    """`encode(text)`, or a prefix's ids once a prefix has more than `max_tokens` tokens.

    Encodes growing prefixes (doubling), so the work is bounded by about twice what max_tokens
    tokens take, however long `text` is.
    """
    num_chars = min(len(text), max(1, max_tokens) * PROBE_CHARS_PER_TOKEN)
    while True:
        ids = encode(text[:num_chars])
        # NOTE: the last token of a prefix may merge differently in the whole text; the others
        # are the whole text's, so more than max_tokens + 1 of them is already too many.
        if num_chars >= len(text) or len(ids) > max_tokens + 1:
            return ids
        num_chars = min(len(text), 2 * num_chars)


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
            max_prompt_chars = default_max_prompt_chars(tokenizer, max_model_len)
        self.max_prompt_chars = max_prompt_chars
        self._local = threading.local()
        # Special tokens' text: in a message it is shielded from the template's tokenisation.
        self.control_texts = control_texts(tokenizer)
        self.pool = WorkerPool("pagedattn-tokenize", num_workers)
        self.small_pool = WorkerPool("pagedattn-tokenize-small", 1)

    @property
    def pools(self) -> tuple[WorkerPool, ...]:
        return self.pool, self.small_pool

    def close(self) -> None:
        for pool in self.pools:
            pool.close()

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

    async def run(self, fn: Callable[..., Any], *args: Any, num_chars: int | None = None) -> Any:
        """`fn(*args)` on a worker thread: the small lane when the input is short."""
        small = num_chars is not None and num_chars <= SMALL_PROMPT_CHARS
        return await (self.small_pool if small else self.pool).run(fn, *args)

    def _check_chars(self, num_chars: int, param: str) -> None:
        check_prompt_chars(num_chars, self.max_prompt_chars, self.max_model_len, param)

    def _check_tokens(self, ids: Sequence[int], param: str) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty: send at least one token", param)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens or more, but the model's max_model_len is "
                f"{self.max_model_len} (prompt plus at least one new token); shorten it",
                param=param,
            )
        return list(ids)

    def _encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.local_tokenizer()

        def encode(text: str) -> list[int]:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))

        return encode_bounded(encode, prompt, self.max_model_len)

    async def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """Token ids of a text or token-id prompt; raises InvalidRequestError if it cannot fit."""
        if isinstance(prompt, list):
            return self._check_tokens(prompt, param)
        if not prompt:
            raise InvalidRequestError("the prompt is empty: send at least one token", param)
        self._check_chars(len(prompt), param)
        ids = await self.run(self._encode, prompt, num_chars=len(prompt))
        return self._check_tokens(ids, param)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None,
        kwargs: dict[str, Any],
        add_generation_prompt: bool = True,
    ) -> list[int]:
        tok = self.local_tokenizer()
        if tools is not None:
            kwargs = {**kwargs, "tools": tools}
        messages, marks = shield(messages, self.control_texts)
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        # NOTE: the template already holds any BOS token; do not add special tokens again.
        if marks:
            return encode_shielded(
                text, marks, lambda t: self._encode(t, add_special_tokens=False), tok
            )
        return self._encode(text, add_special_tokens=False)

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        model_name: str,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a chat rendered with the model's template (`tools` as its variable)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError(
                f"model {model_name} has no chat template: use /v1/completions", param="messages"
            )
        num_chars = sum(_num_message_chars(m) for m in messages)
        num_chars += len(json.dumps(tools, ensure_ascii=False)) if tools else 0
        self._check_chars(num_chars, "messages")
        ids = await self.run(
            self._render,
            messages,
            tools,
            template_kwargs or {},
            add_generation_prompt,
            num_chars=num_chars,
        )
        return self._check_tokens(ids, "messages")


def _num_message_chars(message: dict[str, Any]) -> int:
    """A message's content length, plus the JSON of its other fields beyond role and content."""
    rest = {k: v for k, v in message.items() if k not in ("role", "content")}
    content = message.get("content") or ""
    return len(content) + (len(json.dumps(rest, ensure_ascii=False)) if rest else 0)
