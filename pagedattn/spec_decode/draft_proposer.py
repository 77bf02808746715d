"""A draft model proposes: its own runner, paged cache and block tables, the same manager code."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedattn.config import ConfigError, SpeculativeConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.request import Request
from pagedattn.core.scheduler_output import DecodingRequest, ScheduledRequest, SchedulerOutput
from pagedattn.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedattn.config import EngineConfig

_GREEDY = SamplingParams(temperature=0.0)


class DraftProposer:
    """Runs the draft model greedily K steps ahead of each sequence.

    Each target sequence has a draft-side Request whose tokens are the target's accepted tokens
    only (so its block hashes never cover a draft); the draft cache also holds the K-1 drafts it
    computed. Before the next proposal the draft cache rolls back to the longest prefix it
    shares with the target's tokens (free_rejected_slots, as the target's cache does).
    """

    def __init__(
        self, config: EngineConfig, max_model_len: int, target_vocab: dict[str, int]
    ) -> None:
        """``max_model_len`` and ``target_vocab``: the target model's (token -> id)."""
        from pagedattn.worker.model_runner import ModelRunner

        spec = config.speculative
        draft_config = dataclasses.replace(
            config,
            model=dataclasses.replace(config.model, model=spec.draft_model),
            cache=dataclasses.replace(config.cache, kv_store=None, kv_events_endpoint=None),
            speculative=SpeculativeConfig(),
        )
        self.runner = ModelRunner(draft_config)
        if self.runner.tokenizer.get_vocab() != target_vocab:
            raise ConfigError(
                f"draft model {spec.draft_model!r} does not share the target's tokenizer: a "
                "draft model must use the same vocabulary (token ids) as the target"
            )
        self.block_size = config.cache.block_size
        self.manager = KVCacheManager(
            self.runner.kv_cache_groups,
            self.runner.num_blocks,
            enable_caching=config.cache.enable_prefix_caching,
            hash_seed=config.cache.hash_seed,
        )
        self.max_model_len = min(self.runner.max_model_len, max_model_len)
        self.seqs: dict[str, Request] = {}
        # Tokens whose K/V the draft cache holds, per sequence (accepted ones, then drafts).
        self.computed: dict[str, list[int]] = {}

    def propose(self, requests: Sequence[DecodingRequest], slots: Sequence[int]) -> list[list[int]]:
        """Up to slots[i] draft tokens for each request (fewer where the draft cache is full)."""
        drafts: dict[str, list[int]] = {r.req_id: [] for r in requests}
        active = []
        for request, num_slots in zip(requests, slots, strict=True):
            seq = self._sync(request)
            if seq is not None and request.num_tokens + num_slots <= self.max_model_len:
                active.append((request, seq, num_slots))
        for step in range(max((k for _, _, k in active), default=0)):
            scheduled = []
            for request, seq, num_slots in active:
                if step >= num_slots or (step and not drafts[request.req_id]):
                    continue
                tokens = seq.all_token_ids + drafts[request.req_id]
                start = seq.num_computed_tokens
                if self.manager.allocate_slots(seq, len(tokens) - start) is None:
                    continue  # NOTE: the draft pool is full: fewer drafts, never a preemption
                seq.num_computed_tokens = len(tokens)
                self.computed[seq.request_id] = tokens
                scheduled.append(
                    ScheduledRequest(
                        req_id=seq.request_id,
                        token_ids=tokens[start:],
                        start_pos=start,
                        block_ids=self.manager.get_block_ids(seq.request_id),
                        needs_sample=True,
                        sampling_params=_GREEDY,
                        seed=None,
                        prompt_token_ids=seq.prompt_token_ids,
                        output_token_ids=seq.output_token_ids,
                    )
                )
            if not scheduled:
                break
            counts = {s.req_id: len(s.token_ids) for s in scheduled}
            output = self.runner.execute(
                SchedulerOutput(
                    scheduled,
                    counts,
                    sum(counts.values()),
                    block_copies=self.manager.take_block_copies(),
                )
            )
            for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
                drafts[req_id].append(token)
        return [drafts[r.req_id] for r in requests]

    def finish(self, request_ids) -> None:
        """Free the draft cache of finished sequences."""
        for req_id in request_ids:
            seq = self.seqs.pop(req_id, None)
            self.computed.pop(req_id, None)
            if seq is not None:
                self.manager.free(seq)

    def _sync(self, request: DecodingRequest) -> Request | None:
        """The draft-side sequence, its tokens caught up with the target's and its cache rolled
        back to their common prefix."""
        seq = self.seqs.get(request.req_id)
        if seq is None:
            seq = Request(
                request.req_id,
                request.token_ids,
                block_size=self.block_size,
                hash_seed=self.manager.hash_seed,
            )
            self.seqs[request.req_id] = seq
            self.computed[request.req_id] = []
        else:
            seq.append_output_token_ids(request.token_ids[seq.num_tokens :])
        computed = self.computed[request.req_id]
        common = 0
        limit = min(len(computed), seq.num_tokens - 1)
        target = seq.all_token_ids
        while common < limit and computed[common] == target[common]:
            common += 1
        del computed[common:]
        seq.num_computed_tokens = common
        self.manager.free_rejected_slots(seq)
        return seq
