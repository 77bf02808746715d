"""LoRALinear's batched shrink/expand against a per-row reference."""

from __future__ import annotations

import pytest
import torch

from pagedattn.lora.layers import LoRABatch, LoRALinear
from pagedattn.model.layers import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_own_adapter_and_base_rows_stay_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    base = Linear(32, 24)
    base.weight.data = torch.randn(24, 32, generator=gen).to(dtype)
    batch = LoRABatch()
    layer = LoRALinear(base, [8, 16], 3, 8, batch, dtype, torch.device("cpu"))
    # Slot 0: rank 4 on both slices; slot 2: rank 8 on slice 1 only; slot 1 stays empty.
    pairs = {
        0: [(torch.randn(4, 32, generator=gen), torch.randn(n, 4, generator=gen)) for n in (8, 16)],
        2: [None, (torch.randn(8, 32, generator=gen), torch.randn(16, 8, generator=gen))],
    }
    for slot, p in pairs.items():
        pairs_in_dtype = [None if x is None else (x[0].to(dtype), x[1].to(dtype)) for x in p]
        layer.set_slot(slot, layer.pack(pairs_in_dtype))
    x = torch.randn(6, 32, generator=gen).to(dtype)
    slots = [0, -1, 2, 2, 1, 0]
    batch.set(torch.tensor(slots))
    y = layer(x)
    ref = base(x).float()
    for row, slot in enumerate(slots):
        for i, (off, n) in enumerate(((0, 8), (8, 16))):
            pair = pairs.get(slot, [None, None])[i]
            if pair is not None:
                a, b = (t.to(dtype).float() for t in pair)
                ref[row, off : off + n] += b @ (a @ x[row].float())
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol * 0.2)
    # Rows without an adapter (or with an empty slot) are exactly the base layer's output.
    assert torch.equal(y[1], base(x)[1]) and torch.equal(y[4], base(x)[4])
    batch.set(None)
    assert torch.equal(layer(x), base(x))


def test_slot_reload_leaves_no_stale_ranks_and_unload_restores_the_base():
    gen = torch.Generator().manual_seed(1)
    base = Linear(16, 12)
    base.weight.data = torch.randn(12, 16, generator=gen)
    batch = LoRABatch()
    layer = LoRALinear(base, [4, 8], 2, 8, batch, torch.float32, torch.device("cpu"))

    def pairs(rank):
        return [
            (torch.randn(rank, 16, generator=gen), torch.randn(n, rank, generator=gen))
            for n in (4, 8)
        ]

    x = torch.randn(3, 16, generator=gen)
    batch.set(torch.tensor([1, 1, -1]))
    layer.set_slot(1, layer.pack(pairs(8)))  # full rank first
    small = pairs(2)
    layer.set_slot(1, layer.pack(small))  # then rank 2 over it: ranks 2..7 must be zero again
    want = base(x)
    for i, (off, n) in enumerate(((0, 4), (4, 8))):
        a, b = small[i]
        want[:2, off : off + n] += x[:2] @ a.t() @ b.t()
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    layer.set_slot(1, None)  # unload: the slot adds nothing
    assert torch.equal(layer(x), base(x))
