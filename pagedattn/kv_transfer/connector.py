"""KVConnector: the engine's side of the second KV tier (vLLM v1's KV connector, synchronous).

Scheduler side: ``get_num_new_matched_tokens`` says how many prompt tokens past the local
prefix-cache hit the store can supply (whole blocks, contiguous). Worker side: ``load_blocks``
copies those blocks into the paged cache before the step's forward; ``save_blocks`` copies newly
full blocks out after it and hands them to a background writer, so saving never makes a step wait.

A block is looked up only under its own key, whose chained hash carries the tenant's cache salt,
so tenants never share entries; any missing, truncated or mismatched entry means recompute.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from pagedattn.attention.layout import KVCacheLayout, block_size_of, layout_of
from pagedattn.kv_transfer.codec import (
    BlockFormat,
    BlockKeySpace,
    decode_block,
    encode_block,
    split_payload,
)
from pagedattn.kv_transfer.stats import KVConnectorStats
from pagedattn.kv_transfer.store import KVStore, StoreUnavailableError

logger = logging.getLogger(__name__)

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]
# Keys fetched per store round trip while loading (loading stops at the first bad entry).
_LOAD_BATCH_BLOCKS = 16
# Keys remembered as stored, so a block saved or loaded once is not written again.
_MAX_KNOWN_KEYS = 1 << 16


class KVConnector:
    """Loads and saves one KV cache group's blocks (all its layers) through a KVStore.

    Owns the store (close() closes it) and a background writer thread whose queue holds at most
    max_pending_bytes of encoded blocks; a save that would pass that is skipped and counted.
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
    ) -> None:
        layout = KVCacheLayout(layout)
        self.store = store
        self.layout = layout
        self.key_space = BlockKeySpace(model_id, layout.value, dtype, block_size, group_id)
        self.block_size = block_size
        self.layer_indices = None if layer_indices is None else tuple(layer_indices)
        self.max_pending_bytes = max_pending_bytes
        self.min_hit_tokens = min_hit_tokens
        self._format: BlockFormat | None = None
        self._stats = KVConnectorStats()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._known: OrderedDict[str, None] = OrderedDict()
        self._warned_corrupt = False
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-store-writer", daemon=True
        )
        self._writer.start()
        self._closed = False

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

    def _mark_known(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > _MAX_KNOWN_KEYS:
                self._known.popitem(last=False)

    def block_format(self, kv_caches: KVCaches) -> BlockFormat:
        """The value format of this group's blocks in these caches (checked against the config)."""
        layers = self.layer_indices or range(len(kv_caches))
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
        try:
            num_hits = self.store.num_prefix_hits(keys)
        except StoreUnavailableError:
            self._count(num_store_errors=1)
            num_hits = 0
        self._mark_known(keys[:num_hits])
        num_tokens = num_hits * self.block_size
        if num_tokens < self.min_hit_tokens:
            num_tokens = 0
        self._count(
            num_hit_tokens=num_tokens,
            num_miss_tokens=len(candidates) * self.block_size - num_tokens,
        )
        return num_tokens

    # ---- worker side ----

    def load_blocks(
        self, kv_caches: KVCaches, block_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> int:
        """Copy stored blocks into block_ids in every layer of the group; returns how many.

        Stops at the first missing or bad entry (the caller recomputes from there); a bad entry
        is deleted from the store so that the recomputed block replaces it.
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} block hashes")
        if not block_ids:
            return 0
        start = time.perf_counter()
        fmt = self.block_format(kv_caches)
        keys = [self.key_space.key(h) for h in block_hashes]
        payloads, num_bytes = self._fetch_prefix(keys, fmt)
        num_loaded = len(payloads)
        if num_loaded:
            # [n, payload_bytes]: one copy out of the store's bytes, then one per layer into place.
            staging = torch.empty((num_loaded, fmt.payload_bytes), dtype=torch.uint8)
            staging_np = staging.numpy()
            for j, payload in enumerate(payloads):
                staging_np[j] = np.frombuffer(payload, dtype=np.uint8)
            k, v = split_payload(staging, fmt)  # [n, L, *key_shape], [n, L, *value_shape]
            layers = self.layer_indices or range(len(kv_caches))
            device = kv_caches[layers[0]][0].device
            ids = torch.tensor(block_ids[:num_loaded], dtype=torch.long, device=device)
            for i, layer in enumerate(layers):
                key_cache, value_cache = kv_caches[layer]
                key_cache.index_copy_(0, ids, k[:, i].to(device))
                value_cache.index_copy_(0, ids, v[:, i].to(device))
            self._mark_known(keys[:num_loaded])
        self._count(
            num_loaded_blocks=num_loaded,
            num_load_failures=int(num_loaded < len(keys)),
            bytes_read=num_bytes,
            load_time_s=time.perf_counter() - start,
        )
        return num_loaded

    def _fetch_prefix(self, keys: list[str], fmt: BlockFormat) -> tuple[list[memoryview], int]:
        """Verified payloads of keys from the first up to the first bad one, and bytes read."""
        payloads: list[memoryview] = []
        num_bytes = 0
        for start in range(0, len(keys), _LOAD_BATCH_BLOCKS):
            batch = keys[start : start + _LOAD_BATCH_BLOCKS]
            try:
                values = self.store.get_many(batch)
            except StoreUnavailableError:
                self._count(num_store_errors=1)
                return payloads, num_bytes
            for key, value in zip(batch, values, strict=True):
                payload = decode_block(value, fmt, key)
                if payload is None:
                    if value is not None:
                        self._drop_corrupt(key)
                    return payloads, num_bytes
                payloads.append(payload)
                num_bytes += len(value)
        return payloads, num_bytes

    def _drop_corrupt(self, key: str) -> None:
        self._count(num_corrupt_entries=1)
        with self._lock:
            self._known.pop(key, None)
            first, self._warned_corrupt = not self._warned_corrupt, True
        if first:
            logger.warning("kv store entry %s failed verification; recomputing (logged once)", key)
        try:
            self.store.delete(key)
        except StoreUnavailableError:
            self._count(num_store_errors=1)

    def save_blocks(
        self, kv_caches: KVCaches, block_ids: Sequence[int], block_hashes: Sequence[bytes]
    ) -> int:
        """Queue full blocks for the store; returns how many were queued (never waits on I/O).

        The blocks' bytes are copied out before returning, so the blocks may be reused at once.
        Blocks known to be stored are left out; blocks past the queue's byte bound are skipped
        and counted.
        """
        if len(block_ids) != len(block_hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(block_hashes)} block hashes")
        if self._closed:
            raise RuntimeError("save_blocks after close()")
        start = time.perf_counter()
        fmt = self.block_format(kv_caches)
        with self._lock:
            todo = []
            for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
                key = self.key_space.key(block_hash)
                if key not in self._known:
                    todo.append((block_id, key))
            room = (self.max_pending_bytes - self._pending_bytes) // fmt.value_bytes
            num_queued = max(0, min(len(todo), room))
            self._pending_bytes += num_queued * fmt.value_bytes
            self._stats.num_skipped_saves += len(todo) - num_queued
        if num_queued == 0:
            return 0
        todo = todo[:num_queued]
        staging = torch.empty((num_queued, fmt.payload_bytes), dtype=torch.uint8)
        k, v = split_payload(staging, fmt)  # [n, L, *key_shape], [n, L, *value_shape]
        layers = self.layer_indices or range(len(kv_caches))
        device = kv_caches[layers[0]][0].device
        ids = torch.tensor([block_id for block_id, _ in todo], dtype=torch.long, device=device)
        for i, layer in enumerate(layers):
            key_cache, value_cache = kv_caches[layer]
            k[:, i] = key_cache.index_select(0, ids).cpu()
            v[:, i] = value_cache.index_select(0, ids).cpu()
        self._queue.put((fmt, [key for _, key in todo], staging))
        self._count(save_copy_time_s=time.perf_counter() - start)
        return num_queued

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except Exception:  # NOTE: the writer must outlive any one bad job.
                logger.exception("kv store writer failed on a batch; its blocks are not stored")
            finally:
                self._queue.task_done()

    def _write(self, fmt: BlockFormat, keys: list[str], staging: torch.Tensor) -> None:
        start = time.perf_counter()
        staging_np = staging.numpy()
        num_saved = num_bytes = 0
        try:
            for j, key in enumerate(keys):
                value = encode_block(fmt, key, staging_np[j])
                self.store.put(key, value)
                self._mark_known([key])
                num_saved += 1
                num_bytes += len(value)
        except StoreUnavailableError:
            self._count(num_store_errors=1)
        finally:
            with self._lock:
                self._pending_bytes -= len(keys) * fmt.value_bytes
                self._stats.num_saved_blocks += num_saved
                self._stats.num_failed_saves += len(keys) - num_saved
                self._stats.bytes_written += num_bytes
                self._stats.write_time_s += time.perf_counter() - start

    def flush(self) -> None:
        """Wait until every queued block has been written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the writer and close the store."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        self.store.close()
