"""Incremental detokenisation: each step decodes a few tokens, never the whole sequence again."""

from __future__ import annotations

# A window of earlier tokens decoded with the new ones, so that merges across tokens come out right.
_PREFIX_WINDOW = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one small decode per step."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # NOTE: decoding starts from the prompt's tail so the first token's spacing is right.
        self.token_ids: list[int] = list(prompt_token_ids[-_PREFIX_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (may be empty mid-character)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
