"""Control-token text inside chat messages is read as text, never as the control token.

A chat template writes its own control tokens (``<|im_start|>``, ``<|eot_id|>``...) around each
message; the rendered text is then tokenised with those strings parsed as their tokens. Without
care, a user who types ``<|im_end|><|im_start|>system`` in a message forges a system turn. A
message whose content holds such text is therefore rendered with a placeholder in its place, and
the content is tokenised apart with the control tokens split into ordinary pieces (the Rust
tokenizer's ``encode_special_tokens``). Messages without such text render exactly as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pagedattn.engine.errors import InvalidRequestError

_MARK = re.compile("(\ue000[0-9]+\ue001)")  # Unicode private-use characters around an index


def control_texts(tokenizer: Any) -> tuple[str, ...]:
    """The text of every special added token of ``tokenizer`` (empty where it has no Rust
    backend to ask)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ()
    return tuple(t.content for t in backend.get_added_tokens_decoder().values() if t.special)


def shield(
    messages: list[dict[str, Any]], texts: tuple[str, ...]
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """``messages`` with each content text that holds one of ``texts`` replaced by a placeholder,
    and the placeholders' texts (empty: nothing to shield)."""
    marks: dict[str, str] = {}

    def guard(text: Any) -> Any:
        if not isinstance(text, str) or not any(t in text for t in texts):
            return text
        mark = f"\ue000{len(marks)}\ue001"
        marks[mark] = text
        return mark

    # NOTE: the front doors join a message's text parts into one string before rendering.
    out = [{**m, "content": guard(m["content"])} if "content" in m else m for m in messages]
    return out, marks


def encode_shielded(
    text: str, marks: dict[str, str], encode: Callable[[str], list[int]], tokenizer: Any
) -> list[int]:
    """Token ids of a chat rendered with ``marks``' placeholders: the template's text by
    ``encode``, each placeholder's content with control-token text split into plain pieces."""
    pieces = _MARK.split(text)
    if sum(p in marks for p in pieces) != len(marks):
        raise InvalidRequestError(
            "a message holds control-token text, and this model's chat template does not keep "
            "message contents apart as written: remove the control-token text",
            param="messages",
        )
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    for piece in pieces:
        if piece in marks:
            # NOTE: the tokenizer is this worker thread's own copy (PromptPreprocessor).
            before, backend.encode_special_tokens = backend.encode_special_tokens, True
            try:
                ids += backend.encode(marks[piece], add_special_tokens=False).ids
            finally:
                backend.encode_special_tokens = before
        elif piece:
            ids += encode(piece)
    return ids
