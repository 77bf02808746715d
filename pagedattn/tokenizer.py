"""LightTokenizer: a tokenizer.json with its special tokens and chat template, without transformers.

It answers the part of transformers' tokenizer API that pagedattn uses (encode, decode, chat
templates, special and vocabulary lookups) with the same results, through the Rust `tokenizers`
library that transformers' fast tokenizers wrap. A GGUF model's tokenizer is converted by
transformers once and saved in this form (model/gguf_loader.py), so a repeat start does not
import transformers (about 1.5 s of a 4-5 s start).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pagedattn.chat_template import render_chat_template

TOKENIZER_FILE = "tokenizer.json"
SETTINGS_FILE = "tokenizer_settings.json"
SETTINGS_VERSION = 1


class TokenizerFormatError(ValueError):
    """Saved tokenizer files are missing, damaged or of another format version."""


class LightTokenizer:
    """A Rust tokenizer and what transformers keeps beside it (special tokens, chat template)."""

    def __init__(
        self, backend: Tokenizer, settings: dict[str, Any], name_or_path: str = ""
    ) -> None:
        # NOTE: transformers switches truncation and padding off before each encode and sets
        # whether special-token text is split; done once here, the tokenizer is never changed.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(settings["split_special_tokens"])
        self.backend_tokenizer = backend
        self.settings = settings
        self.name_or_path = name_or_path
        self.chat_template: str | dict[str, str] | None = settings["chat_template"]
        self.special_tokens_map: dict[str, str] = dict(settings["special_tokens_map"])
        self.all_special_tokens: list[str] = list(settings["all_special_tokens"])
        self.all_special_ids: list[int] = self.convert_tokens_to_ids(self.all_special_tokens)
        self.clean_up_tokenization_spaces = bool(settings["clean_up_tokenization_spaces"])

    @classmethod
    def from_hf(cls, hf: Any) -> LightTokenizer:
        """The same tokenizer as a transformers fast tokenizer (taken as it is, not imported)."""
        if not getattr(hf, "is_fast", False):
            raise TokenizerFormatError(
                f"{type(hf).__name__} is not a fast (Rust-backed) tokenizer; it cannot be saved "
                "as tokenizer.json"
            )
        backend = Tokenizer.from_str(hf.backend_tokenizer.to_str())
        clean_up = bool(hf.clean_up_tokenization_spaces)
        # NOTE: transformers skips this WordPiece clean-up for BPE models unless forced.
        forced = getattr(
            hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False
        )
        if type(hf.backend_tokenizer.model).__name__ == "BPE" and not forced:
            clean_up = False
        settings = {
            "version": SETTINGS_VERSION,
            "special_tokens_map": dict(hf.special_tokens_map),
            "all_special_tokens": list(hf.all_special_tokens),
            "chat_template": hf.chat_template,
            "clean_up_tokenization_spaces": clean_up,
            "split_special_tokens": bool(getattr(hf, "split_special_tokens", False)),
        }
        return cls(backend, settings, str(hf.name_or_path))

    @classmethod
    def load(cls, folder: Path, name_or_path: str = "") -> LightTokenizer:
        """The tokenizer saved in ``folder``; TokenizerFormatError if it is absent or damaged."""
        try:
            settings = json.loads((folder / SETTINGS_FILE).read_text())
            backend = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        except Exception as exc:  # NOTE: tokenizers raises a plain Exception for a bad file
            raise TokenizerFormatError(f"no readable tokenizer in {folder}: {exc}") from exc
        if not isinstance(settings, dict) or settings.get("version") != SETTINGS_VERSION:
            raise TokenizerFormatError(f"{folder / SETTINGS_FILE} is of another format version")
        return cls(backend, settings, name_or_path)

    def save(self, folder: Path) -> None:
        """Write tokenizer.json, then the settings file, into ``folder``; OSError if it cannot.

        Each file is written whole and renamed into place, the settings last, so a reader
        (another process starting) never loads half a tokenizer.
        """
        folder.mkdir(parents=True, exist_ok=True)
        files = {
            TOKENIZER_FILE: self.backend_tokenizer.to_str(),
            SETTINGS_FILE: json.dumps(self.settings, indent=1),
        }
        for name, text in files.items():
            tmp = folder / f".{name}.{os.getpid()}"
            try:
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, folder / name)
            finally:
                tmp.unlink(missing_ok=True)

    def __deepcopy__(self, memo: dict) -> LightTokenizer:
        # NOTE: a Rust tokenizer used by two threads at once can fail ("Already borrowed"); a copy
        # per thread gets its own.
        backend = Tokenizer.from_str(self.backend_tokenizer.to_str())
        return LightTokenizer(backend, self.settings, self.name_or_path)

    # Vocabulary and special tokens.

    def __len__(self) -> int:
        """Vocabulary size with the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Vocabulary size without the added tokens."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included (a new dict on each call)."""
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """The id of each token text; the unknown token's id (or None) for a text not in it."""
        if isinstance(tokens, str):
            token_id = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if token_id is None else token_id
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        """The token text of each id."""
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def _special(self, name: str) -> str | None:
        return self.special_tokens_map.get(name)

    @property
    def bos_token(self) -> str | None:
        return self._special("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special("eos_token")

    @property
    def unk_token(self) -> str | None:
        return self._special("unk_token")

    @property
    def pad_token(self) -> str | None:
        return self._special("pad_token")

    def _special_id(self, name: str) -> int | None:
        token = self._special(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def unk_token_id(self) -> int | None:
        token = self._special("unk_token")
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    # Text <-> ids.

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the BOS/EOS the post-processor adds when asked)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids``."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(
        self,
        conversation: Sequence[Any],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **template_kwargs: Any,
    ) -> str | list[int] | dict[str, list[int]]:
        """One conversation rendered by the chat template; with ``tokenize``, its token ids
        (as {"input_ids": ids} unless ``return_dict=False``, like transformers 5)."""
        text = render_chat_template(
            self._template(tools),
            conversation,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **{**self.special_tokens_map, **template_kwargs},
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids

    def _template(self, tools: list[dict] | None) -> str:
        template = self.chat_template
        if isinstance(template, dict):  # named templates: "tool_use" with tools, else "default"
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            if name not in template:
                raise ValueError(
                    f"this model has several chat templates ({sorted(template)}) and no default"
                )
            template = template[name]
        if template is None:
            raise ValueError("this tokenizer has no chat template")
        return template


def _clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text
