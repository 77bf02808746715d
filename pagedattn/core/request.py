"""Request: token ids, progress counters and incremental block hashes of one sequence."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedattn.core.kv_cache_utils import BlockHash, extend_block_hashes, init_root_hash

if TYPE_CHECKING:
    from pagedattn.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life: waiting, running, preempted or finished (and why)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request's own step failed; the others went on

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the FINISHED_* statuses."""
        return status.value >= RequestStatus.FINISHED_STOPPED.value


class Request:
    """One sequence: prompt + output token ids, computed-token counter and block hashes.

    With `block_size` set, `block_hashes` holds the chained hash of every full block of
    `all_token_ids`; it is extended (never recomputed) as output tokens arrive. With
    `block_size=None` no hashes are kept (prefix caching off).
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "arrival_time",
        "priority",
        "cache_salt",
        "lora_id",
        "mm_hashes",
        "eos_token_ids",
        "seed",
        "num_pending_forks",
        "max_tokens",
        "output_token_ids",
        "all_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "num_recomputed_tokens",
        "block_hashes",
        "block_size",
        "hash_seed",
        "status",
        "spec_token_ids",
        "_root_hash",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_id: str | None = None,
        mm_hashes: Sequence[tuple[int, int, str]] = (),
        eos_token_ids: Sequence[int] = (),
        seed: int | None = None,
        num_forks: int = 0,
        max_tokens: int | None = None,
        block_size: int | None = None,
        hash_seed: str = "pagedattn",
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(
                f"request {request_id!r}: the prompt is empty; give at least one token"
            )
        if min(prompt_token_ids) < 0:
            raise ValueError(f"request {request_id!r}: token ids must be >= 0")
        if block_size is not None and block_size < 1:
            raise ValueError(f"request {request_id!r}: block_size={block_size} must be >= 1")
        for mm in mm_hashes:
            if len(mm) != 3 or mm[0] < 0 or mm[1] < 1:
                raise ValueError(
                    f"request {request_id!r}: mm_hashes entry {mm!r} must be "
                    "(offset >= 0, length >= 1, hash)"
                )
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Lower value = more important (vLLM convention).
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_id = lora_id
        self.mm_hashes = sorted(tuple(mm) for mm in mm_hashes)
        self.eos_token_ids = tuple(eos_token_ids)
        # The sampler's seed for this sequence (None: the runner's shared generator).
        self.seed = seed
        # Siblings (n > 1) still to fork from this sequence once its prompt is computed.
        self.num_pending_forks = num_forks
        # Output-token limit (None: up to max_model_len); the scheduler stops the request there.
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)
        # Tokens whose K/V are in the cache; advanced by the scheduler.
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.status = RequestStatus.WAITING
        # NOTE: draft tokens proposed for the next step only; never in all_token_ids, so never
        # hashed or cached until the target model accepts them (they arrive as output tokens).
        self.spec_token_ids: list[int] = []
        self._root_hash = init_root_hash(hash_seed)
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        """True once the request has a FINISHED_* status."""
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Append generated tokens; hashes every block they fill."""
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)
        block_size = self.block_size
        if block_size is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * (
            block_size
        ):
            self._update_block_hashes()

    def fork(self, request_id: str, seed: int | None = None) -> Request:
        """A sibling with a new id and the same tokens, params, salt and priority.

        It shares nothing mutable with this request; the KV cache manager shares the blocks.
        """
        child = Request.__new__(Request)
        for name in Request.__slots__:
            setattr(child, name, getattr(self, name))
        child.request_id = request_id
        child.seed = seed
        child.num_pending_forks = 0
        child.spec_token_ids = []
        child.prompt_token_ids = list(self.prompt_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.mm_hashes = list(self.mm_hashes)
        return child

    def replace_last_output_token(self, token_id: int) -> None:
        """Swap the last generated token (not yet computed) for another one (beam search)."""
        if not self.output_token_ids or self.num_computed_tokens >= self.num_tokens:
            raise ValueError(
                f"request {self.request_id!r}: only a generated token that is not yet in the "
                "KV cache can be replaced"
            )
        self.output_token_ids[-1] = token_id
        self.all_token_ids[-1] = token_id
        if self.block_size is not None and len(self.block_hashes) * self.block_size == (
            self.num_tokens
        ):
            # NOTE: the token closed a block: that block's hash (and no other) changes.
            del self.block_hashes[-1]
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self.block_size is None:
            return
        extend_block_hashes(
            self.block_hashes,
            self.all_token_ids,
            self.block_size,
            self._root_hash,
            self.lora_id,
            self.mm_hashes,
            self.cache_salt,
        )

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})"
        )
