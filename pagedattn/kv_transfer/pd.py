"""Prefill/decode disaggregation at the engine level: the two roles and what passes between them.

A prefill engine runs a request with ``max_tokens=1``: its steps compute the prompt's KV and the
first token, and its ``ExportConnector`` saves the prompt's full blocks into the outbox. The
``KVTransferParams`` it returns (vLLM's ``kv_transfer_params``: the block keys and where to pull
them) go with the prompt and the first token to a decode engine, which pulls the blocks its own
prefix cache lacks into its inbox and continues the request as ``prompt + [first token]``; its
scheduler sees the inbox as a store hit, so the blocks load before its first step and only the
prompt's last partial block and the first token are computed. A transfer that fails, times out or
fails the checksum leaves blocks out of the inbox, and the decode engine computes them itself.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedattn.attention.layout import block_size_of, layout_of
from pagedattn.core.kv_cache_utils import hash_request_tokens, make_block_hash_with_group_id
from pagedattn.distributed.zmq_auth import CurveKeys
from pagedattn.kv_transfer.codec import decode_block
from pagedattn.kv_transfer.direct import (
    BlockServer,
    ExportConnector,
    ImportConnector,
    PullWorker,
    attach_connector,
    pull_into,
)
from pagedattn.kv_transfer.memory_store import MemoryKVStore, TieredKVStore
from pagedattn.kv_transfer.store import KVStore
from pagedattn.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Default deadline of one block pull; past it the decode side recomputes the prompt.
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
# A BlockServer found unreachable (its replica died) is not asked again for this long: pulls
# from it recompute at once instead of each waiting for the connection to fail.
UNREACHABLE_TTL_S = 30.0
# Pulled blocks are copied into the decode cache at most this many bytes per engine call,
# between steps, ahead of their request (DecodeRole.preload_piece): a 4,096-token float32
# prompt of the default model (188 MB) is 12 pieces, none of which stalls a decode step long.
PRELOAD_PIECE_BYTES = 16 << 20


@dataclass(frozen=True)
class KVTransferParams:
    """What a prefill replica hands to a decode replica with the prompt and the first token."""

    prompt_token_ids: tuple[int, ...]
    first_token_id: int
    cache_salt: str | None
    # Store keys of the prompt's full blocks, first block first (salted chained hashes).
    block_keys: tuple[str, ...]
    block_hashes: tuple[bytes, ...]
    # The prefill replica's BlockServer (tcp://host:port).
    remote_endpoint: str


@dataclass(frozen=True)
class TransferResult:
    """One pull: blocks the decode cache already held, blocks and bytes pulled, seconds."""

    num_local_blocks: int
    num_blocks: int
    num_bytes: int
    seconds: float


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The params of a request's prefill half: the same sampling, one token."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def decode_params(params: SamplingParams) -> SamplingParams:
    """The params of a request's decode half: the tokens after the first."""
    max_tokens = None if params.max_tokens is None else params.max_tokens - 1
    return dataclasses.replace(
        params, max_tokens=max_tokens, min_tokens=max(0, params.min_tokens - 1)
    )


def can_disaggregate(params: SamplingParams) -> bool:
    """True when a request's decode half, started from prompt + first token, samples exactly
    as one engine would: one sequence, no logprobs, no penalties or grammar over its output."""
    return (
        params.n == 1
        and (params.best_of or 1) == 1
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.structured_outputs is None
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
    )


def needs_decode(params: SamplingParams, finish_reason: str | None) -> bool:
    """True when a prefill half that ended with finish_reason leaves tokens to generate."""
    if not can_disaggregate(params):
        return False
    return finish_reason == "length" and (params.max_tokens is None or params.max_tokens > 1)


def _connector(cls, engine, store: KVStore, max_pending_bytes: int, **kwargs):
    runner = engine.runner
    if runner.num_groups != 1:
        raise ValueError(
            f"prefill/decode disaggregation needs a model with one KV cache group; "
            f"{engine.model_name} has {runner.num_groups}"
        )
    key_cache = runner.kv_caches[0][0]
    return cls(
        store,
        model_id=engine.model_name,
        layout=layout_of(key_cache),
        dtype=runner.kv_cache_dtype,
        block_size=block_size_of(key_cache),
        max_pending_bytes=max_pending_bytes,
        **kwargs,
    )


def _kv_cache_bytes(engine) -> int:
    return int(engine.runner.kv_cache_plan.num_bytes)


class PrefillRole:
    """Makes an LLMEngine a prefill engine: an outbox of its blocks and a server for pulls;
    with ``fallback`` (the shared file/Redis store) its blocks are saved there too.

    ``endpoint``: where the BlockServer binds (loopback by default); ``advertised_host``: the
    host decode replicas pull from (default: the bound one, e.g. the node's address for a
    wildcard bind); ``curve``: the deployment's keys (only its decode replicas can pull; Ray
    Serve's PD replicas always pass them).
    """

    def __init__(
        self,
        engine,
        *,
        outbox_bytes: int | None = None,
        endpoint: str = "tcp://127.0.0.1:*",
        fallback: KVStore | None = None,
        curve: CurveKeys | None = None,
        advertised_host: str | None = None,
    ) -> None:
        self.engine = engine
        size = outbox_bytes or _kv_cache_bytes(engine) + (64 << 20)
        self.outbox = MemoryKVStore(size)
        store = self.outbox if fallback is None else TieredKVStore(self.outbox, fallback)
        self.connector = _connector(ExportConnector, engine, store, size)
        attach_connector(engine, self.connector)
        self.server = BlockServer(self.outbox, endpoint, curve)
        self.endpoint = self.server.endpoint
        if advertised_host is not None:
            port = self.endpoint.rpartition(":")[2]
            self.endpoint = f"tcp://{advertised_host}:{port}"

    def transfer_params(
        self, prompt_token_ids: Sequence[int], first_token_id: int, cache_salt: str | None
    ) -> KVTransferParams:
        """The params for a finished prefill half; waits until its blocks are in the outbox."""
        self.connector.flush()
        cache = self.engine.config.cache
        hashes = hash_request_tokens(
            cache.block_size, prompt_token_ids, cache.hash_seed, cache_salt=cache_salt
        )
        return KVTransferParams(
            tuple(prompt_token_ids),
            int(first_token_id),
            cache_salt,
            tuple(self.connector.key_space.key(h) for h in hashes),
            tuple(hashes),
            self.endpoint,
        )

    def close(self) -> None:
        self.server.close()


class DecodeRole:
    """Makes an LLMEngine a decode engine: pulled blocks load from its inbox before its first
    step; ``fallback`` (the shared file/Redis store) is read for blocks the pull lacked.

    Pulled values are verified (checksum over key and payload) in the pulling thread, so the
    engine step that loads them only copies. ``curve``: the deployment's keys (the prefill
    side's BlockServer admits only the deployment's clients).
    """

    def __init__(
        self,
        engine,
        *,
        inbox_bytes: int | None = None,
        fallback: KVStore | None = None,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        curve: CurveKeys | None = None,
    ) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.curve = curve
        size = inbox_bytes or _kv_cache_bytes(engine) + (64 << 20)
        self.inbox = MemoryKVStore(size, pop_on_read=True)
        store = self.inbox if fallback is None else TieredKVStore(self.inbox, fallback)
        self.connector = _connector(ImportConnector, engine, store, 0, verified=self.inbox)
        attach_connector(engine, self.connector)
        self._format = self.connector.block_format(engine.runner.kv_caches)
        self.num_corrupt = 0
        # BlockServer endpoint -> time.monotonic() until which it counts as unreachable.
        self._unreachable: dict[str, float] = {}
        self.num_skipped_pulls = 0
        self.num_preloaded_blocks = 0
        self.puller = PullWorker()

    def _verify(self, key: str, value: memoryview) -> bool:
        """The codec's check (header, BLAKE2b over key and payload), in the pulling thread."""
        if decode_block(value, self._format, key) is not None:
            return True
        self.num_corrupt += 1
        logger.warning("pulled block %s failed verification; recomputing from it", key)
        return False

    def num_local_blocks(self, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of the prompt this engine's prefix cache holds now (not pulled)."""
        cached = self.engine.kv_cache_manager.block_pool.cached_block_hash_to_block
        num = 0
        for block_hash in block_hashes:
            if make_block_hash_with_group_id(block_hash, 0) not in cached:
                break
            num += 1
        return num

    def pull(self, tp: KVTransferParams) -> TransferResult:
        """Pull the blocks this engine lacks into the inbox (nothing on failure: recompute)."""
        num_local = self.num_local_blocks(tp.block_hashes)
        keys = tp.block_keys[num_local:]
        if keys and self.is_unreachable(tp.remote_endpoint):
            self.num_skipped_pulls += 1
            return TransferResult(num_local, 0, 0, 0.0)
        num_blocks, num_bytes, seconds = pull_into(
            self.inbox,
            tp.remote_endpoint,
            keys,
            self.timeout_s,
            self._verify,
            on_unreachable=self.mark_unreachable,
            ctx=self.puller.ctx,
            curve=self.curve,
        )
        return TransferResult(num_local, num_blocks, num_bytes, seconds)

    def mark_unreachable(self, endpoint: str) -> None:
        """Pulls from endpoint recompute at once for UNREACHABLE_TTL_S (its replica is gone)."""
        self._unreachable[endpoint] = time.monotonic() + UNREACHABLE_TTL_S

    def is_unreachable(self, endpoint: str) -> bool:
        until = self._unreachable.get(endpoint)
        if until is None or time.monotonic() >= until:
            self._unreachable.pop(endpoint, None)
            return False
        return True

    @property
    def piece_blocks(self) -> int:
        """Blocks per preload piece (PRELOAD_PIECE_BYTES of this cache's blocks)."""
        return max(1, PRELOAD_PIECE_BYTES // self._format.value_bytes)

    def preload_piece(self, engine, tp: KVTransferParams, start: int, end: int) -> int:
        """On the engine's loop thread, between steps: copy pulled blocks ``start..`` (at most
        PRELOAD_PIECE_BYTES, never past ``end``) into free blocks of the cache and index them in
        its prefix cache, unreferenced, as a finished request leaves its blocks. Returns how many
        blocks it advanced (already cached ones included); 0 means stop here: what is left in
        the inbox loads in the request's first step, as before, or is recomputed.

        NOTE: the request then finds these blocks as a local prefix-cache hit, so its first
        step copies at most the last piece; each call stalls the decode streams for one piece's
        copy only.
        """
        manager = engine.kv_cache_manager
        pool = manager.block_pool
        if not manager.enable_caching or start >= end:
            return 0
        cached = pool.cached_block_hash_to_block
        num_skipped = 0
        while start + num_skipped < end and (
            make_block_hash_with_group_id(tp.block_hashes[start + num_skipped], 0) in cached
        ):
            num_skipped += 1
        if num_skipped:
            self.inbox.discard(tp.block_keys[start : start + num_skipped])
            return num_skipped
        per_piece = self.piece_blocks
        num = min(per_piece, end - start)
        # NOTE: only while the rest of the prompt fits in free blocks with room to spare, so that
        # these blocks evict nothing this prompt needs and the running streams keep their room.
        if pool.get_num_free_blocks() < (end - start) + per_piece:
            return 0
        blocks = pool.get_new_blocks(num)
        kv_caches = engine.runner.kv_caches
        ids = [block.block_id for block in blocks]
        num_loaded = self.connector.load_blocks(
            kv_caches, ids, tp.block_hashes[start : start + num]
        )
        group = (0).to_bytes(4, "big")
        # NOTE: padded so that block i lines up with hash i (BlockStored's parent is hash i-1).
        pool.cache_full_blocks(
            [None] * start + blocks, tp.block_hashes, start, start + num_loaded, group
        )
        pool.free_blocks(reversed(blocks))
        self.num_preloaded_blocks += num_loaded
        return num_loaded

    def release(self, tp: KVTransferParams) -> None:
        """Drop what the request's first step did not load (it finished or was aborted)."""
        self.inbox.discard(tp.block_keys)

    def submit_pull(self, tp: KVTransferParams):
        """A Future of pull(tp): on the pull thread (lower CPU priority than the engine loop)
        when it is more than one preload piece, else None (pull it on a thread of normal
        priority: its few milliseconds of CPU are worth more to the stream waiting on it)."""
        if len(tp.block_keys) <= self.piece_blocks:
            return None
        return self.puller.submit(self.pull, tp)

    def close(self) -> None:
        self.puller.close()
        self.connector.close()


def decode_prompt(tp: KVTransferParams) -> list[int]:
    """The decode half's prompt: the prompt and the first token."""
    return [*tp.prompt_token_ids, tp.first_token_id]
