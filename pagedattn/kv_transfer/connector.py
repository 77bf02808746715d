"""KVConnector: the engine's side of the second KV tier (vLLM v1's KV connector, synchronous).

Scheduler side: ``get_num_new_matched_tokens`` says how many prompt tokens past the local
prefix-cache hit the store can supply (whole blocks, contiguous). Worker side: ``load_blocks``
copies those blocks into the paged cache before the step's forward; ``save_blocks`` copies newly
full blocks out after it and hands them to a background writer, so saving never makes a step wait.

A block is looked up only under its own key, whose chained hash carries the tenant's cache salt,
so tenants never share entries; any missing, truncated or mismatched entry means recompute.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from pagedattn.attention.fp8 import raw_bytes
from pagedattn.attention.layout import KVCacheLayout, block_size_of, layout_of
from pagedattn.kv_transfer.codec import (
    HEADER_BYTES,
    BlockFormat,
    BlockKeySpace,
    decode_block,
    split_payload,
)
from pagedattn.kv_transfer.stats import KVConnectorStats
from pagedattn.kv_transfer.store import KVStore, StoreUnavailableError
from pagedattn.kv_transfer.writer import BlockWriter, SaveJob

logger = logging.getLogger(__name__)

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
# Blocks fetched per store round trip and load thread (loading stops at the first bad entry).
_LOAD_CHUNK_BLOCKS = 8
# Keys remembered as stored, so a block saved or loaded once is not written again.
_MAX_KNOWN_KEYS = 1 << 16
# Deadline of one store lookup or one load in the engine's step (a hung read: a stuck network
# mount); past it the step recomputes, and the store is skipped until the read returns.
DEFAULT_LOAD_TIMEOUT_S = 2.0


class KVConnector:
    """Loads and saves one KV cache group's blocks (all its layers) through a KVStore.

    Owns the store (close() closes it), a background writer whose queue holds at most
    max_pending_bytes of blocks (a save past that is skipped and counted), and num_load_threads
    threads that fetch and verify blocks while loading. A lookup or load that takes longer than
    load_timeout_s is given up (the step recomputes); while a given-up read is still running,
    the store is not asked again.
    """

    def __init__(
        self,
        store: KVStore,
        model_id: str,
        layout: KVCacheLayout | str,
        dtype: torch.dtype,
        block_size: int,
        *,
        group_id: int = 0,
        layer_indices: Sequence[int] | None = None,
        max_pending_bytes: int = 256 << 20,
        min_hit_tokens: int = 0,
        num_load_threads: int = 2,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
    ) -> None:
        if not load_timeout_s > 0:
            raise ValueError(f"load_timeout_s={load_timeout_s!r} is invalid: use seconds > 0")
        layout = KVCacheLayout(layout)
        self.store = store
        self.layout = layout
        self.key_space = BlockKeySpace(model_id, layout.value, dtype, block_size, group_id)
        self.block_size = block_size
        self.layer_indices = None if layer_indices is None else tuple(layer_indices)
        self.min_hit_tokens = min_hit_tokens
        self._format: BlockFormat | None = None
        self._stats = KVConnectorStats()
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()
        self._warned_corrupt = False
        self._warned_store_bug = False
        self._writer = BlockWriter(
            store, max_pending_bytes, self._count, self._mark_known, self._store_failed
        )
        self._load_pool = ThreadPoolExecutor(num_load_threads, thread_name_prefix="kv-store-load")
        self.load_timeout_s = load_timeout_s
        # Store reads given up at their deadline and not yet returned.
        self._abandoned: list[Future] = []
        self._warned_timeout = False

    # ---- bookkeeping ----

    @property
    def stats(self) -> KVConnectorStats:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def _store_failed(self, error: Exception) -> None:
        """Count a failed store call; anything but StoreUnavailableError (a bug) is logged once."""
        self._count(num_store_errors=1)
        if isinstance(error, StoreUnavailableError):
            return  # NOTE: the store's circuit breaker has logged the outage.
        with self._lock:
            first, self._warned_store_bug = not self._warned_store_bug, True
        if first:
            logger.error(
                "kv store %s raised %s; treated as unavailable (logged once)",
                self.store.name,
                type(error).__name__,
                exc_info=error,
            )

    def _stalled(self) -> bool:
        """True while a store read given up at its deadline is still running."""
        with self._lock:
            self._abandoned = [f for f in self._abandoned if not f.done()]
            return bool(self._abandoned)

    def _timed_out(self, futures: Sequence[Future], what: str) -> None:
        """Count a read past its deadline and remember the reads still running."""
        self._count(num_load_timeouts=1)
        with self._lock:
            self._abandoned += [f for f in futures if not f.done()]
            first, self._warned_timeout = not self._warned_timeout, True
        if first:
            logger.warning(
                "kv store %s: %s took more than %.1f s; recomputing, and skipping the store "
                "until the read returns (logged once)",
                self.store.name,
                what,
                self.load_timeout_s,
            )

    def _mark_known(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > _MAX_KNOWN_KEYS:
                self._known.popitem(last=False)

    def _layers(self, kv_caches: KVCaches) -> Sequence[int]:
        return self.layer_indices or range(len(kv_caches))

    def block_format(self, kv_caches: KVCaches) -> BlockFormat:
        """The value format of this group's blocks in these caches (checked against the config)."""
        layers = self._layers(kv_caches)
        key_cache, value_cache = kv_caches[layers[0]]
        if key_cache.dtype != self.key_space.dtype:
            raise ValueError(
                f"KV cache dtype {key_cache.dtype} differs from the connector's "
                f"{self.key_space.dtype}"
            )
        if layout_of(key_cache) is not self.layout or block_size_of(key_cache) != self.block_size:
            raise ValueError(
                f"KV cache of shape {tuple(key_cache.shape)} is not the connector's "
                f"{self.layout.value} layout with block_size={self.block_size}"
            )
        fmt = self._format
        key_shape, value_shape = tuple(key_cache.shape[1:]), tuple(value_cache.shape[1:])
        if fmt is None or (fmt.key_shape, fmt.value_shape) != (key_shape, value_shape):
            fmt = BlockFormat(key_cache.dtype, len(layers), key_shape, value_shape)
            self._format = fmt
        return fmt

    # ---- scheduler side ----

    def get_num_new_matched_tokens(
        self, block_hashes: Sequence[bytes], num_computed_tokens: int
    ) -> int:
        """Tokens past num_computed_tokens (the local hit) in contiguous full blocks the store has.

        NOTE: the caller still computes at least the prompt's last token (its logits are needed),
        so it caps the total hit below the prompt length, as for a local prefix-cache hit.
        """
        if num_computed_tokens % self.block_size:
            return 0
        candidates = block_hashes[num_computed_tokens // self.block_size :]
        if not candidates:
            return 0
        keys = [self.key_space.key(h) for h in candidates]
        num_hits = self._num_prefix_hits(keys)
        self._mark_known(keys[:num_hits])
        num_tokens = num_hits * self.block_size
        if num_tokens < self.min_hit_tokens:
            num_tokens = 0
        # NOTE: hits are counted when the blocks load (load_blocks), not on the store's word.
        self._count(num_miss_tokens=len(candidates) * self.block_size - num_tokens)
        return num_tokens

    def _num_prefix_hits(self, keys: list[str]) -> int:
        """The store's prefix hits among keys, within the deadline; 0 if it fails or stalls."""
        if self._stalled():
            return 0
        lookup = None
        try:
            if self._writer.closed:  # NOTE: the pool is shut down: no deadline after close()
                return self.store.num_prefix_hits(keys)
            lookup = self._load_pool.submit(self.store.num_prefix_hits, keys)
            return lookup.result(timeout=self.load_timeout_s)
        except Exception as error:  # NOTE: no store failure may fail a request.
            if lookup is None or lookup.done():
                self._store_failed(error)
            else:
                self._timed_out([lookup], "a lookup")
            return 0

    # ---- worker side ----

    def load_blocks(
        self, kv_caches: KVCaches, block_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> int:
        """Copy stored blocks into block_ids in every layer of the group; returns how many.

        Stops at the first missing or bad entry (the caller recomputes from there); a bad entry
        is deleted from the store so that the recomputed block replaces it. Chunks of blocks are
        fetched and verified on a few threads (file reads, sockets and BLAKE2b release the GIL);
        chunks not done by the deadline count as missing.
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} block hashes")
        if not block_ids:
            return 0
        start = time.perf_counter()
        fmt = self.block_format(kv_caches)
        keys = [self.key_space.key(h) for h in block_hashes]
        # [n, value_bytes]: each value is read (or copied) into its row and verified in place.
        staging = torch.empty((len(keys), fmt.value_bytes), dtype=torch.uint8)
        staging_np = staging.numpy()
        chunks = [
            range(first, min(first + _LOAD_CHUNK_BLOCKS, len(keys)))
            for first in range(0, len(keys), _LOAD_CHUNK_BLOCKS)
        ]
        num_loaded = num_bytes = 0
        if not self._stalled():
            futures = [
                self._load_pool.submit(self._fetch, keys, rows, fmt, staging_np) for rows in chunks
            ]
            _, not_done = wait(futures, timeout=self.load_timeout_s)
            if not_done:
                # NOTE: a late chunk writes into this call's own staging rows, never the cache.
                self._timed_out(futures, f"a load of {len(keys)} blocks")
            for rows, future in zip(chunks, futures, strict=True):
                if future in not_done:
                    break
                num_good, chunk_bytes = future.result()
                num_loaded += num_good
                num_bytes += chunk_bytes
                if num_good < len(rows):
                    break
        if num_loaded:
            payloads = staging[:num_loaded, HEADER_BYTES : HEADER_BYTES + fmt.payload_bytes]
            k, v = split_payload(payloads, fmt)  # [n, L, *key_shape], [n, L, *value_shape]
            layers = self._layers(kv_caches)
            device = kv_caches[layers[0]][0].device
            ids = torch.tensor(block_ids[:num_loaded], dtype=torch.long, device=device)
            for i, layer in enumerate(layers):
                for cache, src in zip(kv_caches[layer], (k, v), strict=True):
                    # NOTE: 2-D rows [n, block elements]; a 5-D strided index_copy_ is ~10x slower.
                    # NOTE: as bytes: torch has no index_copy_ for fp8 caches.
                    rows = raw_bytes(cache).view(cache.shape[0], -1)
                    rows.index_copy_(
                        0, ids, raw_bytes(src[:, i]).reshape(num_loaded, -1).to(device)
                    )
            self._mark_known(keys[:num_loaded])
        num_failed = len(keys) - num_loaded
        self._count(
            num_hit_tokens=num_loaded * self.block_size,
            num_miss_tokens=num_failed * self.block_size,
            num_loaded_blocks=num_loaded,
            num_failed_load_blocks=num_failed,
            num_load_failures=int(num_failed > 0),
            bytes_read=num_bytes,
            load_time_s=time.perf_counter() - start,
        )
        return num_loaded

    def _fetch(
        self, keys: list[str], rows: range, fmt: BlockFormat, staging: np.ndarray
    ) -> tuple[int, int]:
        """Fetch and verify keys[rows] into staging[rows]: (leading good entries, their bytes)."""
        try:
            outs = [staging[row] for row in rows]  # NOTE: views; staging[rows] would copy
            lengths = self.store.get_many_into([keys[row] for row in rows], outs)
        except Exception as error:
            self._store_failed(error)
            return 0, 0
        num_good = num_bytes = 0
        for row, length in zip(rows, lengths, strict=True):
            if length is None:
                with self._lock:  # NOTE: evicted since it was seen: let the recompute save it
                    self._known.pop(keys[row], None)
                break
            if length != fmt.value_bytes or decode_block(staging[row], fmt, keys[row]) is None:
                self._drop_corrupt(keys[row])
                break
            num_good += 1
            num_bytes += length
        return num_good, num_bytes

    def _drop_corrupt(self, key: str) -> None:
        self._count(num_corrupt_entries=1)
        with self._lock:
            self._known.pop(key, None)
            first, self._warned_corrupt = not self._warned_corrupt, True
        if first:
            logger.warning("kv store entry %s failed verification; recomputing (logged once)", key)
        try:
            self.store.delete(key)
        except Exception as error:
            self._store_failed(error)

    def save_blocks(
        self, kv_caches: KVCaches, block_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> int:
        """Queue full blocks for the store; returns how many were queued (never waits on I/O).

        The blocks' bytes are copied out before returning, so the blocks may be reused at once.
        Blocks known to be stored are left out; blocks past the writer's byte bound are skipped
        and counted.
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} block hashes")
        start = time.perf_counter()
        fmt = self.block_format(kv_caches)
        with self._lock:
            todo = [
                (block_id, key)
                for block_id, key in zip(
                    block_ids, (self.key_space.key(h) for h in block_hashes), strict=True
                )
                if key not in self._known
            ]
        num_queued = self._writer.reserve(len(todo), fmt.value_bytes)
        self._count(num_skipped_saves=len(todo) - num_queued)
        if num_queued == 0:
            return 0
        todo = todo[:num_queued]
        layers = self._layers(kv_caches)
        device = kv_caches[layers[0]][0].device
        ids = torch.tensor([block_id for block_id, _ in todo], dtype=torch.long, device=device)
        # Layer-major [L, n, block elements]: one gather per layer, straight into place.
        k = torch.empty((len(layers), num_queued, math.prod(fmt.key_shape)), dtype=fmt.dtype)
        v = torch.empty((len(layers), num_queued, math.prod(fmt.value_shape)), dtype=fmt.dtype)
        for i, layer in enumerate(layers):
            for cache, out in zip(kv_caches[layer], (k[i], v[i]), strict=True):
                rows = cache.view(cache.shape[0], -1)  # [num_blocks, block elements]
                if device.type == "cpu":
                    torch.index_select(rows, 0, ids, out=out)
                else:
                    out.copy_(rows.index_select(0, ids))
        job = SaveJob(fmt, [key for _, key in todo], _bytes_view(k), _bytes_view(v))
        self._writer.submit(job)
        self._count(save_copy_time_s=time.perf_counter() - start)
        return num_queued

    def flush(self) -> None:
        """Wait until every queued block has been written (or failed)."""
        self._writer.flush()

    def close(self) -> None:
        """Write what is queued, stop the threads and close the store."""
        if self._writer.closed:
            return
        self._writer.close()
        # NOTE: a read given up at its deadline may never return: do not wait for it.
        self._load_pool.shutdown(wait=not self._stalled(), cancel_futures=True)
        self.store.close()


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """uint8 [..., bytes of the last dim] over a contiguous CPU tensor (bf16 included)."""
    return tensor.view(torch.uint8).numpy()


def connector_for_engine(
    url: str, model_id: str, num_groups: int, kv_caches: KVCaches, dtype: torch.dtype
) -> KVConnector:
    """The connector an engine uses for ``kv_store=url``; closed (flushed) at exit.

    Only models with one KV cache group: a hybrid model's sliding-window group is refused.
    """
    from pagedattn.config import ConfigError
    from pagedattn.kv_transfer.store import make_store

    if num_groups != 1:
        raise ConfigError(
            f"kv_store works with models of one KV cache group (full attention); {model_id} "
            f"has {num_groups}: leave kv_store unset for it"
        )
    key_cache = kv_caches[0][0]
    connector = KVConnector(
        make_store(url),
        model_id=model_id,
        layout=layout_of(key_cache),
        dtype=dtype,
        block_size=block_size_of(key_cache),
    )
    atexit.register(connector.close)  # NOTE: flushes the writer's queue at exit
    return connector
