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


def pytest_sessionstart(session) -> None:
    """In CI the compiled CPU extension must build: a broken build would otherwise turn every
    kernel test into a skip (they skip where the extension cannot be built, e.g. no compiler)."""
    import os

    if os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        return
    from pagedattn.cpu import extension

    try:
        extension.load_extension()
    except extension.ExtensionBuildError as exc:
        raise pytest.UsageError(f"CI: the compiled CPU extension did not build: {exc}") from exc
