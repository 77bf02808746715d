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
