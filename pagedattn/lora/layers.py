"""LoRALinear: a base linear layer plus stacked adapter slots, applied per row (punica-style).

Per step the manager sets one ``LoRABatch``: a [T, max_loras] one-hot mask of each token row's
slot (all-zero for rows without an adapter). Each wrapped layer then adds

    shrink: h = x @ A_all            [T, S * max_loras * R]   (every slot at once)
    mask:   h *= mask                (rows keep only their own slot's R columns)
    expand: y[:, slice_i] += h_i @ B_i    [T, max_loras * R] @ [max_loras * R, out_i]

for its S output slices (q/k/v of a fused qkv_proj, gate/up of gate_up_proj). Rows of no
adapter add exact zeros, padded ranks are zero rows of A and B, and the scaling is in B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRABatch:
    """The step's per-row slot mask, shared by every LoRALinear; mask None: no row adapts."""

    mask: torch.Tensor | None = None  # [T, max_loras] in the model dtype


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
    ) -> None:
        super().__init__()
        self.base = base
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
        self.lora_b = [
            torch.zeros(max_loras * max_rank, size, dtype=dtype, device=device) for size in slices
        ]

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A [r, in], B [out_i, r]) per slice into ``slot``; None zeroes."""
        loras, rank = self.max_loras, self.max_rank
        a_view = self.lora_a.view(self.in_features, len(self.slices), loras, rank)
        for i, pair in enumerate(pairs):
            a_slot = a_view[:, i, slot]  # [in, R]
            b_slot = self.lora_b[i][slot * rank : (slot + 1) * rank]  # [R, out_i]
            a_slot.zero_()
            b_slot.zero_()
            if pair is not None:
                a, b = pair
                r = a.shape[0]
                a_slot[:, :r].copy_(a.t())
                b_slot[:r].copy_(b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = self.batch.mask
        if mask is None:
            return y
        x2 = x.reshape(-1, self.in_features)
        num_rows = x2.shape[0]
        h = torch.mm(x2, self.lora_a)  # shrink: [T, S * L * R]
        h = h.view(num_rows, len(self.slices), self.max_loras, self.max_rank)
        h.mul_(mask.view(num_rows, 1, self.max_loras, 1))
        y2 = y.view(num_rows, self.out_features)
        for i, (offset, size) in enumerate(zip(self.offsets, self.slices, strict=True)):
            # expand: [T, L * R] @ [L * R, out_i], added into the slice's columns.
            hi = h[:, i].reshape(num_rows, self.max_loras * self.max_rank)
            y2[:, offset : offset + size].addmm_(hi, self.lora_b[i])
        return y

    def extra_repr(self) -> str:
        return f"slices={self.slices}, max_loras={self.max_loras}, max_rank={self.max_rank}"
