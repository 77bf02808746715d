"""Build the engine's Speculator from the config: n-gram lookup or a draft model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedattn.spec_decode.speculator import Speculator

if TYPE_CHECKING:
    from pagedattn.config import EngineConfig


def make_speculator(config: EngineConfig, max_model_len: int, tokenizer) -> Speculator:
    """The Speculator of --speculative-method for a target of max_model_len whose tokenizer a
    draft model must share."""
    spec = config.speculative
    proposer = None
    if spec.speculative_method == "draft":
        from pagedattn.spec_decode.draft_proposer import DraftProposer

        proposer = DraftProposer(config, max_model_len, tokenizer.get_vocab())
    return Speculator(spec, max_model_len, proposer)
