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
# Size limits a server puts on one constraint before compiling it: compile time grows with the
# size (a 40,000-string enum took 90 s of one core), and a compile cannot be interrupted.
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 16_384
MAX_SCHEMA_CHARS = 16_384
MAX_REGEX_CHARS = 2_048
MAX_GRAMMAR_CHARS = 16_384


def check_constraint_size(params: StructuredOutputsParams) -> None:
    """Raise InvalidStructuredOutputsError if the constraint is larger than a server compiles."""
    kind, spec = params.key
    if kind == "choice":
        choices = params.choice or ()
        if len(choices) > MAX_CHOICES:
            _too_large(f"{len(choices)} choices", f"{MAX_CHOICES} choices")
        num_chars = sum(len(c) for c in choices)
        if num_chars > MAX_CHOICE_CHARS:
            _too_large(f"choices of {num_chars} characters", f"{MAX_CHOICE_CHARS} in all")
        return
    limits = {"json": MAX_SCHEMA_CHARS, "regex": MAX_REGEX_CHARS, "grammar": MAX_GRAMMAR_CHARS}
    limit = limits.get(kind)
    if limit is not None and len(spec) > limit:
        _too_large(f"a {kind} of {len(spec)} characters", f"{limit} characters")


def _too_large(what: str, limit: str) -> None:
    raise InvalidStructuredOutputsError(
        f"the output constraint is too large to compile: {what}, more than this server accepts "
        f"({limit}); send a smaller constraint (fewer choices, a shorter schema, regex or grammar)"
    )


_REGEX_SPECIAL = re.compile(r"([.^$*+?()\[\]{}|\\/-])")


def _choice_regex(choices: tuple[str, ...]) -> str:
    """A regex matching exactly one of the strings."""
    # NOTE: not re.escape, which also escapes spaces ("\ "), an escape xgrammar warns about.
    return "(" + "|".join(_REGEX_SPECIAL.sub(r"\\\1", c) for c in choices) + ")"


def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's TokenizerInfo of a transformers tokenizer or of a LightTokenizer.

    A LightTokenizer takes the steps xgrammar's from_huggingface takes for a fast tokenizer (which
    it recognises only by class): vocabulary, stop id, and the vocabulary type and prefix space
    detected from tokenizer.json, overridden by the vocabulary itself where the two disagree.
    """
    import xgrammar as xgr

    from pagedattn.tokenizer import LightTokenizer

    if not isinstance(tokenizer, LightTokenizer):
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    vocab = tokenizer.get_vocab()
    encoded_vocab = [""] * vocab_size
    for token, token_id in vocab.items():
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo
    metadata = info._detect_metadata_from_hf(tokenizer.backend_tokenizer.to_str())
    vocab_type = info._detect_vocab_type_from_vocab(vocab)
    if vocab_type is not None and vocab_type != metadata["vocab_type"]:
        prefix_space = info._detect_add_prefix_space_by_encoding(tokenizer, vocab_type)
        metadata = {"vocab_type": vocab_type, "add_prefix_space": prefix_space}
    return xgr.TokenizerInfo(
        encoded_vocab,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=None if eos is None else [eos],
        add_prefix_space=metadata["add_prefix_space"],
    )


class GrammarCache:
    """One tokenizer's xgrammar compiler, and its compiled grammars keyed by spec."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size)
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
