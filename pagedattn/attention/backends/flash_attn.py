"""FlashAttention-2 through the same interface (GPU only, guarded import; untested in this repo).

Uses ``flash_attn_varlen_func(..., block_table=...)`` on the flash layout. Upstream FA2 requires
the page (block) size to be a multiple of 256, so smaller block sizes raise; use 'triton' then.
"""

from __future__ import annotations

import torch

from pagedattn.attention.backends.base import AttentionBackend
from pagedattn.attention.layout import KVCacheLayout, block_size_of
from pagedattn.attention.metadata import AttentionMetadata

try:
    from flash_attn import flash_attn_varlen_func
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError("flash_attn is not installed; use the 'triton' backend") from exc

# FA2's paged KV path only supports page sizes that are multiples of this.
FLASH_ATTN_PAGE_MULTIPLE = 256
# FA2's "no limit" value for each side of window_size.
_NO_WINDOW = -1


class FlashAttnBackend(AttentionBackend):
    """FlashAttention-2 varlen kernel reading the paged cache through block_table."""

    name = "flash_attn"
    layout = KVCacheLayout.FLASH

    def forward(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        """Causal (bottom-right aligned) varlen attention over the paged cache."""
        if key_cache.element_size() == 1:
            raise ValueError("flash_attn does not read an fp8 KV cache; use the 'triton' backend")
        block_size = block_size_of(key_cache)
        if block_size % FLASH_ATTN_PAGE_MULTIPLE:
            raise ValueError(
                f"flash_attn needs block_size to be a multiple of {FLASH_ATTN_PAGE_MULTIPLE} "
                f"(got {block_size}); use the 'triton' backend or a larger block size"
            )
        seq_lens = metadata.seq_lens
        cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(seq_lens, dim=0, out=cu_seqlens_k[1:])
        # Our window admits keys with pos > q_pos - W, i.e. W - 1 keys to the left of the query.
        left = _NO_WINDOW if sliding_window is None else sliding_window - 1
        return flash_attn_varlen_func(
            query[: metadata.num_actual_tokens],
            key_cache,
            value_cache,
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=(left, _NO_WINDOW),
            softcap=logits_soft_cap or 0.0,
            block_table=metadata.block_tables,
        )
