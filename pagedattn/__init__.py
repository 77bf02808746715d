"""pagedattn: an LLM inference engine whose KV cache is paged memory (PagedAttention)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagedattn import envs

# NOTE: before anything runs a torch kernel, so PAGEDATTN_CPU_ISA caps PyTorch's own kernels too.
envs.apply_cpu_isa_cap()

from pagedattn.config import ConfigError, EngineConfig  # noqa: E402
from pagedattn.engine.errors import EngineFaultError, InvalidRequestError  # noqa: E402
from pagedattn.lora.request import LoRARequest  # noqa: E402
from pagedattn.sampling_params import (  # noqa: E402
    BeamSearchParams,
    InvalidSamplingParamsError,
    SamplingParams,
)

if TYPE_CHECKING:
    from pagedattn.engine.llm import LLM
    from pagedattn.engine.llm_engine import LLMEngine
    from pagedattn.engine.outputs import RequestOutput
    from pagedattn.model.loader import ModelNotFoundError

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "BeamSearchParams",
    "LoRARequest",
    "RequestOutput",
    "EngineConfig",
    "ConfigError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "ModelNotFoundError",
    "EngineFaultError",
]
__version__ = "0.1.0"

# NOTE: these pull in torch and the model code; they are imported when first asked for.
_LAZY = {
    "LLM": "pagedattn.engine.llm",
    "LLMEngine": "pagedattn.engine.llm_engine",
    "RequestOutput": "pagedattn.engine.outputs",
    "ModelNotFoundError": "pagedattn.model.loader",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedattn' has no attribute {name!r}")
