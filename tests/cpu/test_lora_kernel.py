"""The compiled LoRA kernel (csrc/lora_cpu.cpp) against LoRALinear's torch path, the reference."""

from __future__ import annotations

import pytest
import torch

from pagedattn.cpu import extension as cpu_ext
from pagedattn.lora.layers import NO_SLOT, LoRABatch, LoRALinear
from pagedattn.model.layers import Linear

pytestmark = pytest.mark.skipif(
    cpu_ext.get_extension() is None, reason="the compiled CPU extension cannot be built here"
)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def random_slots(layer: LoRALinear, slots: list[int], rank: int, gen: torch.Generator) -> None:
    """Random A and B of ``rank`` on every slice of ``layer``'s ``slots``."""
    dtype = layer.lora_a.dtype
    for slot in slots:
        pairs = [
            (
                torch.randn(rank, layer.in_features, generator=gen),
                torch.randn(n, rank, generator=gen),
            )
            for n in layer.slices
        ]
        layer.set_slot(slot, layer.pack([(a.to(dtype), b.to(dtype)) for a, b in pairs]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("slices", "max_rank"), [([40, 24, 24], 16), ([37], 5), ([64, 64], 24)])
def test_kernel_matches_torch_path(dtype, slices, max_rank) -> None:
    ext = cpu_ext.get_extension()
    gen = torch.Generator().manual_seed(0)
    base = Linear(48, sum(slices))
    base.weight.data = torch.randn(sum(slices), 48, generator=gen).to(dtype)
    batch = LoRABatch()
    layer = LoRALinear(base, slices, 3, max_rank, batch, dtype, torch.device("cpu"))
    random_slots(layer, [0, 2], max_rank - 1, gen)  # a padded rank; slot 1 stays empty
    x = torch.randn(11, 48, generator=gen).to(dtype)
    # Slot 0 has 6 rows: a block of 4 and one of 2.
    slots = torch.tensor([0, NO_SLOT, 2, 2, 1, 0, NO_SLOT, 0, 0, 0, 0])
    batch.set(slots)
    want = layer(x)
    got = base(x)
    ext.lora_apply(got, x, slots, layer.lora_a, layer.lora_b, 3, max_rank)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 10, rtol=tol)
    plain = base(x)
    for row in (1, 4, 6):  # no adapter, an empty slot: the base output exactly
        assert torch.equal(got[row], plain[row])
    layer.kernel = ext  # as LoRAManager builds it: the kernel for steps of few rows
    assert torch.equal(layer(x), got)
    with pytest.raises(RuntimeError, match="slot 3"):
        ext.lora_apply(got, x, torch.tensor([3] * 11), layer.lora_a, layer.lora_b, 3, max_rank)
