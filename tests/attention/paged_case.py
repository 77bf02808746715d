"""Random paged-attention test cases and an independent dense fp64 oracle."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedattn.attention.layout import KVCacheLayout, allocate_kv_cache
from pagedattn.attention.metadata import AttentionMetadata
from pagedattn.attention.ops import reshape_and_cache

# (seq_len, query_len) per sequence: decode (q=1) and prefill/chunked prefill spans, ending at,
# before and after block boundaries when scaled by the block size.
MIXED_SPECS = ((2, 0, 1), (2, -1, 1), (1, 1, 1), (3, 1, 5), (2, 0, 7), (0, 9, 9), (1, 0, 1))


def mixed_specs(block_size: int) -> list[tuple[int, int]]:
    """Sequence specs (seq_len, query_len) around block boundaries for the given block size."""
    specs = []
    for num_blocks, delta, q_len in MIXED_SPECS:
        seq_len = max(num_blocks * block_size + delta, q_len, 1)
        specs.append((seq_len, min(q_len, seq_len)))
    return specs


@dataclass
class PagedCase:
    """A batch with its paged cache, metadata and the unpaged per-sequence K/V."""

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence [L, Hkv, D]
    values: list[torch.Tensor]


def make_case(
    specs: list[tuple[int, int]],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_size: int = 32,
    dtype: torch.dtype = torch.float32,
    layout: KVCacheLayout = KVCacheLayout.FLASH,
    shared_prefix_blocks: int = 0,
    seed: int = 0,
) -> PagedCase:
    """Build a random case; blocks are a shuffled, non-contiguous subset of the pool.

    With shared_prefix_blocks = n, sequence 1's first n table entries point at sequence 0's blocks
    (and its first n*B tokens hold the same K/V), as after a prefix-cache hit.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for seq_len, _ in specs]
    num_blocks = 2 * sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for s, n in enumerate(needed):
        if s == 1 and shared_prefix_blocks:
            shared = tables[0][:shared_prefix_blocks]
            tables.append(shared + [pool.pop() for _ in range(n - shared_prefix_blocks)])
        else:
            tables.append([pool.pop() for _ in range(n)])
    keys, values = [], []
    for s, (seq_len, _) in enumerate(specs):
        shape = (seq_len, num_kv_heads, head_size)
        keys.append(torch.randn(shape, generator=gen).to(dtype))
        values.append(torch.randn(shape, generator=gen).to(dtype))
        if s == 1 and shared_prefix_blocks:
            num_shared = shared_prefix_blocks * block_size
            keys[1][:num_shared] = keys[0][:num_shared]
            values[1][:num_shared] = values[0][:num_shared]
    key_cache, value_cache = allocate_kv_cache(
        layout, num_blocks, block_size, num_kv_heads, head_size, dtype
    )
    # NOTE: unused slots hold large finite garbage, so reading a wrong slot changes the output.
    key_cache.copy_(torch.randn(key_cache.shape, generator=gen) * 30)
    value_cache.copy_(torch.randn(value_cache.shape, generator=gen) * 30)
    seq_lens = [seq_len for seq_len, _ in specs]
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, block_size)
    reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache, full.slot_mapping)
    query_lens = [q_len for _, q_len in specs]
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    query = torch.randn((sum(query_lens), num_kv_heads * group, head_size), generator=gen).to(dtype)
    return PagedCase(query, key_cache, value_cache, metadata, keys, values)


def dense_reference(
    case: PagedCase,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """fp64 causal attention on the unpaged K/V of every sequence -> [T, Hq, D] (float64)."""
    outputs = []
    loc = case.metadata.query_start_loc_cpu
    for s, (key, value) in enumerate(zip(case.keys, case.values, strict=True)):
        query = case.query[loc[s] : loc[s + 1]].double()
        q_len, num_heads, _ = query.shape
        seq_len, num_kv_heads, _ = key.shape
        group = num_heads // num_kv_heads
        k = key.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v))
    return torch.cat(outputs)


# (atol, rtol) against the fp64 oracle. bf16 inputs are rounded the same way for both sides;
# the remaining error is bf16 accumulation/outputs (~3 significant digits).
TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.bfloat16: (3e-2, 3e-2)}


def assert_matches_dense(
    backend,
    case: PagedCase,
    *,
    scale: float = 0.17,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    tolerance: tuple[float, float] | None = None,
) -> None:
    """Run backend.forward on the case and compare with the dense fp64 oracle."""
    out = backend.forward(
        case.query,
        case.key_cache,
        case.value_cache,
        case.metadata,
        scale=scale,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    expected = dense_reference(
        case, scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
    )
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    atol, rtol = tolerance or TOLERANCES[case.query.dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
