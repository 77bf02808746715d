"""Model code that reads K/V only through the paged cache, and the checkpoint loaders."""

from pagedattn.model.base import PagedCausalLM, WeightLoadError
from pagedattn.model.gguf_loader import GGUFFormatError
from pagedattn.model.loader import LoadedModel, ModelNotFoundError, load_model
from pagedattn.model.registry import MODEL_REGISTRY, UnsupportedArchitectureError

__all__ = [
    "MODEL_REGISTRY",
    "GGUFFormatError",
    "LoadedModel",
    "ModelNotFoundError",
    "PagedCausalLM",
    "UnsupportedArchitectureError",
    "WeightLoadError",
    "load_model",
]
