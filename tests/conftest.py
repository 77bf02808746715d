"""Fixtures shared across test packages."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """SmolLM2's tokenizer as transformers converts it from the GGUF file (~5 s, once)."""
    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import ModelNotFoundError, packaged_model_path

    try:
        path = packaged_model_path("smollm2-135m")
    except ModelNotFoundError as exc:  # pragma: no cover - the package is a test dependency
        pytest.skip(f"SmolLM2 is not installed: {exc}")
    return GGUFCheckpoint(path).hf_tokenizer()
