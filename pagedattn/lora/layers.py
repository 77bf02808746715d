"""LoRALinear: a base linear layer plus stacked adapter slots, applied per row (punica-style).

Per step the manager sets one ``LoRABatch``: each token row's slot (NO_SLOT for rows without an
adapter). Each wrapped layer, with S output slices (q/k/v of a fused qkv_proj, gate/up of
gate_up_proj), L = max_loras slots and R = max_lora_rank, holds

    A: [L, in, S * R]      slot s's block contiguous (column i * R + r: rank r of slice i)
    B_i: [L * R, out_i]    per slice, slot s's ranks in rows s * R .. s * R + R - 1

and adds, for the rows of each slot s, (x @ A[s]) @ B_s (shrink, then each slice's expand).
Rows of no adapter are not touched, padded ranks are zero rows of A and B, and the scaling is in
B. A slot load is one copy per buffer (``pack`` prepares the padded blocks on any thread).

Given the compiled kernel (``kernel``: the CPU extension, csrc/lora_cpu.cpp), a layer runs it
for every step; the compiled decode stack reads the same buffers and the step's ``slots``.
Without it, the torch code below (a gather, two matmuls and an index_add per slot present) is
the reference the kernel is tested against.
NOTE: the kernel also for prefill-sized steps: in bfloat16, torch.mm builds a oneDNN primitive
for each new row count (ms each, and most prefill steps bring a new one), and addmm_ into a
slice of y took a slow path: the old masked torch path cost ~2-3 ms a layer at 128-450 rows in
bf16, ~3x the kernel (which is faster in float32 too).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

# The slot of a row without an adapter (the compiled kernel's sentinel).
NO_SLOT = -1


@dataclass
class LoRABatch:
    """The step's per-row slots, shared by every LoRALinear and the compiled decode stack."""

    slots: torch.Tensor | None = None  # [T] int64: each row's slot, NO_SLOT for none

    def set(self, slots: torch.Tensor | None) -> None:
        """Set each row's slot (int64 [T], NO_SLOT: none), or None: no row adapts."""
        self.slots = slots


# One slot's buffers, prepared by LoRALinear.pack: A [in, S * R] and each slice's B [R, out_i].
PackedSlot = tuple[torch.Tensor, list[torch.Tensor]]


class LoRALinear(nn.Module):
    """Wraps a linear layer (``in_features``, fused output ``slices``) with adapter slots."""

    def __init__(
        self,
        base: nn.Module,
        slices: list[int],
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
        kernel: ModuleType | None = None,
    ) -> None:
        super().__init__()
        self.base = base
        self.kernel = kernel  # the CPU extension (lora_apply), or None: torch only
        self.in_features = base.in_features
        self.out_features = base.out_features
        assert sum(slices) == self.out_features, (slices, self.out_features)
        self.slices = list(slices)
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = batch
        # NOTE: plain tensors, not parameters: no state_dict entry, no autograd.
        self.lora_a = torch.zeros(
            max_loras, self.in_features, len(slices) * max_rank, dtype=dtype, device=device
        )
        self.lora_b = [
            torch.zeros(max_loras * max_rank, size, dtype=dtype, device=device) for size in slices
        ]

    def pack(self, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> PackedSlot:
        """One adapter's (A [r, in], B [out_i, r]) per slice (None: no LoRA on it) as the padded
        slot blocks set_slot copies in. Touches no layer state: any thread may call it."""
        rank = self.max_rank
        dtype, device = self.lora_a.dtype, self.lora_a.device
        a_block = torch.zeros(self.in_features, len(self.slices), rank, dtype=dtype)
        b_blocks = []
        for i, (pair, size) in enumerate(zip(pairs, self.slices, strict=True)):
            b_block = torch.zeros(rank, size, dtype=dtype)
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                a_block[:, i, :r] = a.t()
                b_block[:r] = b.t()
            b_blocks.append(b_block.to(device))
        return a_block.view(self.in_features, -1).to(device), b_blocks

    def set_slot(self, slot: int, packed: PackedSlot | None) -> None:
        """Copy one adapter's packed blocks into ``slot`` (None zeroes it): one copy per
        buffer, so the engine thread's share of a load is small."""
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        if packed is None:
            self.lora_a[slot].zero_()
            for b in self.lora_b:
                b[rows].zero_()
            return
        a_block, b_blocks = packed
        self.lora_a[slot].copy_(a_block)
        for b, b_block in zip(self.lora_b, b_blocks, strict=True):
            b[rows].copy_(b_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.batch.slots
        if slots is None:
            return y
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y2 = y if y.dim() == 2 else y.view(-1, self.out_features)
        if self.kernel is not None and x2.is_contiguous() and y2.is_contiguous():
            self.kernel.lora_apply(
                y2, x2, slots, self.lora_a, self.lora_b, self.max_loras, self.max_rank
            )
            return y
        rank = self.max_rank
        for s in range(self.max_loras):
            index = (slots == s).nonzero().squeeze(1)
            if index.numel() == 0:
                continue
            h = x2.index_select(0, index) @ self.lora_a[s]  # shrink: [n, S * R]
            rows = slice(s * rank, (s + 1) * rank)
            delta = torch.cat(
                [h[:, i * rank : (i + 1) * rank] @ b[rows] for i, b in enumerate(self.lora_b)],
                dim=1,
            )
            y2.index_add_(0, index, delta)
        return y

    def extra_repr(self) -> str:
        return f"slices={self.slices}, max_loras={self.max_loras}, max_rank={self.max_rank}"
