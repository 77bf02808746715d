"""Compiling structured-output specs to xgrammar grammars, cached per tokenizer and per spec."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

# Compiled grammars kept per tokenizer (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256


_REGEX_SPECIAL = re.compile(r"([.^$*+?()\[\]{}|\\/-])")


def _choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of the strings."""
    # NOTE: not re.escape, which also escapes spaces ("\ "), an escape xgrammar warns about.
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\1", c) for c in choices) + ")"


class GrammarCache:
    """One tokenizer's xgrammar compiler, and its compiled grammars keyed by spec."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)
        self._grammars: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile(self, params: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of `params`; raises InvalidStructuredOutputsError."""
        key = params.key
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        grammar = self._compile(params)
        with self._lock:
            self.num_compiles += 1
            self._grammars[key] = grammar
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

    def _compile(self, params: StructuredOutputsParams):
        kind, spec = params.key
        try:
            # NOTE: compact JSON (no free whitespace): a small model given "any whitespace" can
            # emit blank lines until max_tokens and never close the object.
            if kind == "json":
                return self._compiler.compile_json_schema(
                    json.dumps(params.json), any_whitespace=False
                )
            if kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False
                )
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            if kind == "choice":
                return self._compiler.compile_regex(_choice_regex(params.choice or ()))
            return self._compiler.compile_grammar(spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InvalidStructuredOutputsError(
                f"structured_outputs=... is invalid: the {kind} constraint cannot be compiled: "
                f"{message}"
            ) from None


_caches: dict[tuple, GrammarCache] = {}
_caches_lock = threading.Lock()


def _tokenizer_key(tokenizer, vocab_size: int) -> tuple:
    # NOTE: copies of one tokenizer (the server keeps its own) share a cache.
    name = getattr(tokenizer, "name_or_path", None)
    if not name:
        return ("id", id(tokenizer), vocab_size)
    return ("name", name, len(tokenizer), vocab_size)


def grammar_cache(tokenizer, vocab_size: int) -> GrammarCache:
    """The shared GrammarCache of a tokenizer and model vocab size (created on first use)."""
    key = _tokenizer_key(tokenizer, vocab_size)
    with _caches_lock:
        cache = _caches.get(key)
        if cache is None:
            cache = GrammarCache(tokenizer, vocab_size)
            _caches[key] = cache
        return cache


def compile_structured_outputs(params: StructuredOutputsParams, tokenizer, vocab_size: int):
    """Compile (or fetch from the cache) the grammar of `params` for this tokenizer."""
    return grammar_cache(tokenizer, vocab_size).compile(params)
