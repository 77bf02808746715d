"""pagedattn: an LLM inference engine whose KV cache is paged memory (PagedAttention)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedattn.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from pagedattn.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "BeamSearchParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # NOTE: LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from pagedattn.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagedattn' has no attribute {name!r}")
