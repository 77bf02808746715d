"""KV cache blocks, the free block queue and chained block hashing."""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from hashlib import blake2b

# A block's content hash: 16 bytes (128-bit) of BLAKE2b over parent hash + token ids + extra keys.
BlockHash = bytes
# A block hash followed by the 4-byte KV cache group id: the prefix-cache key (as in vLLM).
BlockHashWithGroupId = bytes

# Block id of the null placeholder block that sliding-window tables hold for dropped blocks.
NULL_BLOCK_ID = 0
# block_id of the two sentinels of FreeKVCacheBlockQueue; never a real block.
_SENTINEL_BLOCK_ID = -2
_HASH_BYTES = 16
_TOKEN_BYTES = 4


class KVCacheError(RuntimeError):
    """Misuse of the KV cache manager or block pool (a bug in the caller)."""


class NoFreeBlocksError(KVCacheError):
    """More blocks were requested from the pool than it has free."""


class BlockDoubleFreeError(KVCacheError):
    """A block was freed while its ref_cnt was already 0."""


class UnknownRequestError(KVCacheError, KeyError):
    """The request id has no blocks in the KV cache manager."""


class KVCacheBlock:
    """One block of B token slots; ref-counted, optionally hashed, linked into the free queue."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
        "lora_id",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # BlockHashWithGroupId while the block is in the prefix cache, else None.
        self.block_hash: BlockHashWithGroupId | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False
        # The LoRA adapter whose hash chain cached this block (meaningful while block_hash is set).
        self.lora_id: str | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={hashed})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks: popleft, append and remove are O(1).

    The head is the least recently freed block (evicted first); freed blocks go to the tail.
    """

    __slots__ = ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        head = KVCacheBlock(_SENTINEL_BLOCK_ID)
        tail = KVCacheBlock(_SENTINEL_BLOCK_ID)
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = tail
        tail.prev_free_block = prev
        self.fake_free_list_head = head
        self.fake_free_list_tail = tail

    def popleft(self) -> KVCacheBlock:
        """Pop the least recently freed block."""
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the n least recently freed blocks, in queue order."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} blocks, only {self.num_free_blocks} are free")
        head = self.fake_free_list_head
        block = head.next_free_block
        out = []
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise KVCacheError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (most recently freed, evicted last)."""
        if block.prev_free_block is not None:
            raise KVCacheError(f"block {block.block_id} is already in the free queue")
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head first (O(n); for tests and debugging)."""
        out = []
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            out.append(block)
            block = block.next_free_block
        return out


@functools.lru_cache(maxsize=16)
def init_root_hash(hash_seed: str) -> BlockHash:
    """The parent hash of a request's first block; equal in every process for one seed."""
    return blake2b(hash_seed.encode(), digest_size=_HASH_BYTES).digest()


def encode_extra_keys(extra_keys: tuple | None) -> bytes:
    """Deterministic bytes for a block's extra keys (repr of str/int tuples; no pickle)."""
    return repr(extra_keys).encode() if extra_keys else b""


def hash_block_tokens(
    parent_block_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """Chained content hash of one full block: H(parent || int32 token ids || extra keys)."""
    data = struct.pack(f"{len(token_ids)}i", *token_ids)
    return blake2b(
        parent_block_hash + data + encode_extra_keys(extra_keys), digest_size=_HASH_BYTES
    ).digest()


def block_extra_keys(
    block_start: int,
    block_end: int,
    lora_id: str | None,
    mm_hashes: Sequence[tuple[int, int, str]],
    cache_salt: str | None,
) -> tuple | None:
    """Extra keys of the block holding tokens [block_start, block_end).

    LoRA id on every block; each multimodal input (offset, length, hash) overlapping the block,
    with its offset; the cache salt on the first block only.
    """
    keys: list[tuple] = []
    if lora_id is not None:
        keys.append(("lora", lora_id))
    for offset, length, mm_hash in mm_hashes:
        if offset < block_end and offset + length > block_start:
            keys.append(("mm", mm_hash, offset))
    if cache_salt is not None and block_start == 0:
        keys.append(("salt", cache_salt))
    return tuple(keys) if keys else None


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root_hash: BlockHash,
    lora_id: str | None = None,
    mm_hashes: Sequence[tuple[int, int, str]] = (),
    cache_salt: str | None = None,
) -> None:
    """Append to block_hashes the hashes of the full blocks of token_ids it does not cover yet."""
    start = len(block_hashes) * block_size
    num_new_blocks = (len(token_ids) - start) // block_size
    if num_new_blocks <= 0:
        return
    end = start + num_new_blocks * block_size
    data = struct.pack(f"{end - start}i", *token_ids[start:end])
    parent = block_hashes[-1] if block_hashes else root_hash
    step = block_size * _TOKEN_BYTES
    plain = lora_id is None and not mm_hashes and (cache_salt is None or start > 0)
    append = block_hashes.append
    for offset in range(0, len(data), step):
        chunk = data[offset : offset + step]
        if not plain:
            block_start = start + offset // _TOKEN_BYTES
            extra = block_extra_keys(
                block_start, block_start + block_size, lora_id, mm_hashes, cache_salt
            )
            chunk += encode_extra_keys(extra)
        parent = blake2b(parent + chunk, digest_size=_HASH_BYTES).digest()
        append(parent)


def hash_request_tokens(
    block_size: int,
    token_ids: Sequence[int],
    hash_seed: str,
    lora_id: str | None = None,
    mm_hashes: Sequence[tuple[int, int, str]] = (),
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Hashes of all full blocks of a token sequence."""
    out: list[BlockHash] = []
    root = init_root_hash(hash_seed)
    extend_block_hashes(out, token_ids, block_size, root, lora_id, mm_hashes, cache_salt)
    return out


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Prefix-cache key: the same content in two KV cache groups lives in two blocks."""
    return block_hash + group_id.to_bytes(4, "big")
