"""What a request may ask for: its context, its sequences per step and its KV cache blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedattn.config import SchedulerConfig
    from pagedattn.core.kv_cache_manager import KVCacheManager
    from pagedattn.core.request import Request
    from pagedattn.core.step_budget import StepTokenBudget


class RequestRejectedError(ValueError):
    """A request can never be scheduled (too long for the model or for the KV cache)."""


class RequestLimits:
    """The scheduler's admission limits: max_model_len, max_num_seqs, the largest step and the
    KV cache pool. A request that passes ``check`` can always run, alone, to its max_tokens."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        step_budget: StepTokenBudget,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.step_budget = step_budget
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len

    def check(self, request: Request) -> None:
        """Raise RequestRejectedError, saying what to change, if the request can never run."""
        num_prompt = request.num_prompt_tokens
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(self.max_model_len - num_prompt, 1)
        num_total = num_prompt + max_tokens
        if num_total > self.max_model_len:
            raise RequestRejectedError(
                f"request {request.request_id!r} needs {num_prompt} prompt + {max_tokens}"
                f" max_tokens = {num_total} tokens, more than max_model_len={self.max_model_len}:"
                " shorten the prompt or lower max_tokens"
            )
        config = self.scheduler_config
        max_step_tokens = self.step_budget.max_tokens
        num_seqs = request.num_pending_forks + 1
        if num_seqs > config.max_num_seqs:
            raise RequestRejectedError(
                f"request {request.request_id!r} asks for {num_seqs} sequences (n/best_of), more"
                f" than max_num_seqs={config.max_num_seqs} can run at once: lower n or best_of"
            )
        if not config.enable_chunked_prefill and num_prompt > max_step_tokens:
            raise RequestRejectedError(
                f"request {request.request_id!r} has {num_prompt} prompt tokens, more than"
                f" max_num_batched_tokens={max_step_tokens} with chunked prefill"
                " off: enable chunked prefill or raise max_num_batched_tokens"
            )
        num_needed = self.num_blocks_needed(num_total)
        num_usable = self.kv_cache_manager.num_usable_blocks
        if num_needed > num_usable:
            raise RequestRejectedError(
                f"request {request.request_id!r} needs {num_needed} KV cache blocks for"
                f" {num_total} tokens, more than the {num_usable} blocks of the pool: lower"
                " max_tokens or give the KV cache more memory"
            )

    def check_fits_together(self, num_seqs: int, num_tokens: int) -> None:
        """Raise unless num_seqs sequences of num_tokens can all run every step (no preemption).

        Beam search needs this: its beams advance in lockstep.
        """
        config = self.scheduler_config
        min_budget = self.step_budget.min_tokens
        if num_seqs > config.max_num_seqs or num_seqs > min_budget:
            raise RequestRejectedError(
                f"{num_seqs} sequences in lockstep need max_num_seqs and max_num_batched_tokens "
                f">= {num_seqs} (they are {config.max_num_seqs} and {min_budget})"
            )
        # NOTE: one more block per sequence for the copy of a shared partial block.
        num_needed = num_seqs * (self.num_blocks_needed(num_tokens) + 1)
        num_usable = self.kv_cache_manager.num_usable_blocks
        if num_needed > num_usable:
            raise RequestRejectedError(
                f"{num_seqs} sequences of {num_tokens} tokens need {num_needed} KV cache blocks, "
                f"more than the {num_usable} of the pool: give the KV cache more memory"
            )

    def max_tokens_that_fit(self, num_prompt_tokens: int) -> int:
        """The most output tokens a request of this prompt can ever hold (context and pool)."""
        block_size = self.kv_cache_manager.block_size
        num_tokens = self.max_model_len
        while num_tokens > num_prompt_tokens and self.num_blocks_needed(num_tokens) > (
            self.kv_cache_manager.num_usable_blocks
        ):
            # NOTE: at most one step per block over the pool's size: a short loop.
            num_tokens = (num_tokens - 1) // block_size * block_size
        return max(num_tokens - num_prompt_tokens, 0)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """KV cache blocks (all groups) a sequence of num_tokens holds at most."""
        return self.kv_cache_manager.num_blocks_needed(num_tokens, self.step_budget.max_tokens)
