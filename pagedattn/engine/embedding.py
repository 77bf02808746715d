"""Embeddings from the served model: pooling requests and the vector they hand back.

An embedding request is an ordinary engine request (scheduled, batched and chunked like any
other, on the same model and KV cache: no second model copy) whose SamplingParams ask for
`pooling` and one greedy token; the runner pools its prompt's final hidden states
(worker/pooler.py). "mean" pooling needs every prompt position computed, so such a request gets
a salt of its own and never reads the prefix cache; "last" pooling may.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from pagedattn.engine.outputs import RequestOutput
from pagedattn.sampling_params import SamplingParams

POOLING_TYPES = ("last", "mean")


def embedding_params(pooling: str) -> SamplingParams:
    """SamplingParams of a pooling request (its one sampled token is discarded)."""
    if pooling not in POOLING_TYPES:
        raise ValueError(f"pooling={pooling!r} is invalid: use one of {list(POOLING_TYPES)}")
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling, detokenize=False)


def embedding_salt(pooling: str, cache_salt: str | None) -> str | None:
    """The cache salt a pooling request runs under: its own for "mean" (no prefix-cache hits)."""
    if pooling == "mean":
        return f"{cache_salt or ''}/embed-{uuid.uuid4().hex}"
    return cache_salt


def finish_embedding(
    vector: list[float], *, normalize: bool = True, dimensions: int | None = None
) -> list[float]:
    """The API's vector: cut to `dimensions` (Matryoshka style), then L2-normalised if asked."""
    if dimensions is not None:
        if not 1 <= dimensions <= len(vector):
            raise ValueError(
                f"dimensions={dimensions} is invalid: use 1 to {len(vector)} (the model's "
                "hidden size)"
            )
        vector = vector[:dimensions]
    if normalize:
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
    return vector


def pooled_of(out: RequestOutput) -> list[float]:
    """The pooled vector a finished pooling request carries; RuntimeError if it has none."""
    vector = out.extra.get("pooled")
    if vector is None:
        raise RuntimeError(
            f"request {out.request_id} finished without its pooled hidden state"
            + (f" ({out.error})" if out.error else "")
        )
    return vector


@dataclass
class EmbeddingOutput:
    """One prompt's embedding."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
