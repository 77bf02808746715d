"""Compiling structured-output specs to xgrammar grammars, cached per tokenizer and per spec."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from pagedattn.structured_output.limits import (  # noqa: F401 (the limits, importable here)
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_REGEX_CHARS,
    MAX_REPEAT,
    MAX_SCHEMA_CHARS,
    check_constraint_size,
)
from pagedattn.structured_output.params import (
    InvalidStructuredOutputsError,
    StructuredOutputsParams,
)

logger = logging.getLogger(__name__)

# Compiled grammars kept per tokenizer (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256


_REGEX_SPECIAL = re.compile(r"([.^$*+?()\[\]{}|\\/-])")
# xgrammar's messages start "[12:00:00] /project/cpp/regex_converter.cc:94: ": its build path.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+\.(?:cc|h|cpp):\d+:\s*")


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


def compile_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """(xgrammar compile method, its text): `compile_<method>(text)` compiles `params`."""
    kind, spec = params.key
    if kind == "json":
        return "json_schema", json.dumps(params.json)
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "choice":
        return "regex", _choice_regex(params.choice or ())
    return ("regex" if kind == "regex" else "grammar"), spec


def _invalid(kind: str, message: str) -> InvalidStructuredOutputsError:
    message = _XGRAMMAR_PREFIX.sub("", message)
    return InvalidStructuredOutputsError(
        f"structured_outputs=... is invalid: the {kind} constraint cannot be compiled: {message}"
    )


class GrammarCache:
    """One tokenizer's xgrammar compiler, and its compiled grammars keyed by spec.

    `compile` compiles in this process (no deadline: the offline LLM); `compile_with_deadline`
    compiles in a GrammarCompileWorker process, killed past its deadline (a server).
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)
        self._grammars: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._worker = None  # a GrammarCompileWorker, started on the first compile with deadline
        self.num_compiles = 0

    def get(self, params: StructuredOutputsParams):
        """The cached CompiledGrammar of `params`, or None (never compiles)."""
        with self._lock:
            grammar = self._grammars.get(params.key)
            if grammar is not None:
                self._grammars.move_to_end(params.key)
            return grammar

    def _put(self, params: StructuredOutputsParams, grammar) -> None:
        with self._lock:
            self.num_compiles += 1
            self._grammars[params.key] = grammar
            while len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)

    def compile(self, params: StructuredOutputsParams):
        """The xgrammar CompiledGrammar of `params`; raises InvalidStructuredOutputsError."""
        grammar = self.get(params)
        if grammar is None:
            method, text = compile_source(params)
            kwargs = {"any_whitespace": False} if method == "json_schema" else {}
            try:
                # NOTE: compact JSON (no free whitespace): a small model given "any whitespace"
                # can emit blank lines until max_tokens and never close the object.
                grammar = getattr(self._compiler, f"compile_{method}")(text, **kwargs)
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise _invalid(params.key[0], first or type(exc).__name__) from None
            self._put(params, grammar)
        return grammar

    def worker(self):
        """The compile process of this tokenizer (created, not started, on first use)."""
        from pagedattn.structured_output.compile_worker import GrammarCompileWorker

        with self._lock:
            if self._worker is None:
                self._worker = GrammarCompileWorker(self.tokenizer_info.serialize_json())
            return self._worker

    def compile_with_deadline(self, params: StructuredOutputsParams, timeout_s: float):
        """Like `compile`, in the compile process, killed after `timeout_s` of compiling.

        Raises InvalidStructuredOutputsError, GrammarCompileTimeout or GrammarWorkerError."""
        import xgrammar as xgr

        from pagedattn.structured_output.compile_worker import GrammarCompileFailed

        grammar = self.get(params)
        if grammar is not None:
            return grammar
        try:
            serialized = self.worker().compile(*compile_source(params), timeout_s)
        except GrammarCompileFailed as exc:
            raise _invalid(params.key[0], str(exc)) from None
        grammar = xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)
        self._put(params, grammar)
        return grammar

    def close(self) -> None:
        """Stop the compile process (compiled grammars stay cached)."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()


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


def cached_grammar(params: StructuredOutputsParams, tokenizer, vocab_size: int):
    """The compiled grammar of `params` if this tokenizer's cache holds it, else None: never
    compiles, never builds a cache (cheap enough for an event loop)."""
    cache = grammar_cache_if_built(tokenizer, vocab_size)
    return None if cache is None else cache.get(params)


def grammar_cache_if_built(tokenizer, vocab_size: int) -> GrammarCache | None:
    """The GrammarCache of a tokenizer if one was built, else None."""
    with _caches_lock:
        return _caches.get(_tokenizer_key(tokenizer, vocab_size))
