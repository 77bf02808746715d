"""LoRALinear: a base linear layer plus stacked adapter slots, applied per row (punica-style).

Per step the manager sets one ``LoRABatch``: a one-hot mask of each token row's slot (all-zero
for rows without an adapter). Each wrapped layer, with S output slices (q/k/v of a fused
qkv_proj, gate/up of gate_up_proj), L = max_loras slots and R = max_lora_rank, then adds

    shrink: h = x @ A_all              [T, S * L * R]   (every slot at once)
    mask:   h *= mask                  (rows keep only their own slot's R columns)
    expand: y += h @ B_blockdiag       [S * L * R, out] (decode-sized T: one call)
            y[:, slice_i] += h_i @ B_i (prefill-sized T: no multiply by the zero blocks)

Rows of no adapter add exact zeros, padded ranks are zero rows of A and B, and the scaling is in
B. NOTE: three torch calls per layer at decode sizes: per-call overhead, not FLOPs, is the cost.
Decode steps on the compiled decode stack do not come here: the stack reads the same buffers
and the step's ``slots`` (csrc/lora_cpu.cpp, only each row's own slot). Given that kernel
(``kernel``: the CPU extension), a layer also runs it for steps of fewer than
PER_SLICE_MIN_ROWS rows (a step mixing new prompts into decode rows); without it, the torch
code below is the reference the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

# Rows from which the expand runs per slice instead of through the block-diagonal B.
PER_SLICE_MIN_ROWS = 64
# The slot of a row without an adapter (the compiled kernel's sentinel).
NO_SLOT = -1


@dataclass
class LoRABatch:
    """The step's per-row slots and slot masks, shared by every LoRALinear and the compiled
    decode stack; mask None: no row adapts."""

    mask: torch.Tensor | None = None  # [T, max_loras] in the model dtype
    slots: torch.Tensor | None = None  # [T] int64: each row's slot, NO_SLOT for none
    # The mask repeated for S slices and R ranks: [T, S * max_loras * R], made once per step.
    repeated: dict[int, torch.Tensor] | None = None

    def set(
        self, slots: torch.Tensor | None, max_loras: int, rank: int, dtype: torch.dtype
    ) -> None:
        """Set each row's slot (int64 [T], NO_SLOT: none), or None: no row adapts."""
        self.slots = slots
        self.mask = None
        self.repeated = None
        if slots is not None:
            # NOTE: NO_SLOT + 1 = 0 is the one-hot column dropped.
            one_hot = torch.nn.functional.one_hot(slots + 1, max_loras + 1)[:, 1:]
            self.mask = one_hot.to(dtype)  # [T, L]
            per_slot = self.mask.repeat_interleave(rank, dim=1)  # [T, L * R]
            self.repeated = {s: per_slot.repeat(1, s) for s in (1, 2, 3)}


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
        self.offsets = [sum(slices[:i]) for i in range(len(slices))]
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch = batch
        width = len(slices) * max_loras * max_rank
        # NOTE: plain tensors, not parameters: no state_dict entry, no autograd.
        self.lora_a = torch.zeros(self.in_features, width, dtype=dtype, device=device)
        # B of every slice on the block diagonal of one [S * L * R, out] matrix (decode), and
        # each slice's B on its own (prefill). NOTE: contiguous copies, not views of the block
        # diagonal: addmm_ with a strided B took a slow path (seconds per prefill step).
        self.lora_b_all = torch.zeros(width, self.out_features, dtype=dtype, device=device)
        block = max_loras * max_rank
        self.lora_b = [torch.zeros(block, size, dtype=dtype, device=device) for size in slices]
        self._b_blocks = [
            self.lora_b_all[i * block : (i + 1) * block, off : off + size]
            for i, (off, size) in enumerate(zip(self.offsets, slices, strict=True))
        ]

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A [r, in], B [out_i, r]) per slice into ``slot``; None zeroes."""
        loras, rank = self.max_loras, self.max_rank
        a_view = self.lora_a.view(self.in_features, len(self.slices), loras, rank)
        for i, pair in enumerate(pairs):
            a_slot = a_view[:, i, slot]  # [in, R]
            rows = slice(slot * rank, (slot + 1) * rank)
            b_slots = (self.lora_b[i][rows], self._b_blocks[i][rows])  # [R, out_i] each
            r = 0
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                a_slot[:, :r].copy_(a.t())
                for b_slot in b_slots:
                    b_slot[:r].copy_(b.t())
            # NOTE: only the padded ranks are zeroed: a full-rank copy is ~half the ops of a load
            # (~1,200 small copies on SmolLM2, the step that loads an adapter waits for them).
            if r < rank:
                a_slot[:, r:].zero_()
                for b_slot in b_slots:
                    b_slot[r:].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        repeated = self.batch.repeated
        if repeated is None:
            return y
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        y2 = y if y.dim() == 2 else y.view(-1, self.out_features)
        small = x2.shape[0] < PER_SLICE_MIN_ROWS
        if self.kernel is not None and small and x2.is_contiguous() and y2.is_contiguous():
            self.kernel.lora_apply(
                y2, x2, self.batch.slots, self.lora_a, self.lora_b, self.max_loras, self.max_rank
            )
            return y
        h = torch.mm(x2, self.lora_a)  # shrink: [T, S * L * R]
        h.mul_(repeated[len(self.slices)])
        if len(self.slices) == 1 or small:
            y2.addmm_(h, self.lora_b_all)
            return y
        block = self.max_loras * self.max_rank
        for i, (offset, size) in enumerate(zip(self.offsets, self.slices, strict=True)):
            hi = h[:, i * block : (i + 1) * block]
            y2[:, offset : offset + size].addmm_(hi, self.lora_b[i])
        return y

    def extra_repr(self) -> str:
        return f"slices={self.slices}, max_loras={self.max_loras}, max_rank={self.max_rank}"
