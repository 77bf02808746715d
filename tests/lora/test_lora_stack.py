"""The decode stack with adapter rows against LoRALinear's torch path (the reference); rows
without an adapter stay the base model's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedattn.cpu import decode_stack as decode_stack_module
from pagedattn.cpu import extension as cpu_ext
from pagedattn.lora.layers import NO_SLOT
from pagedattn.lora.manager import LoRAManager
from pagedattn.model.loader import load_model
from tests.cpu.test_lora_kernel import TOLERANCE, random_slots
from tests.model.paged_driver import PagedDriver
from tests.model.tiny import make_tiny_llama

pytestmark = pytest.mark.skipif(
    cpu_ext.get_extension() is None, reason="the compiled CPU extension cannot be built here"
)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_stack_with_lora_rows_matches_the_torch_path(tmp_path, monkeypatch, dtype) -> None:
    model = load_model(str(make_tiny_llama(tmp_path)), dtype, "cpu", "cpu").model
    stack = model.decode_stack
    assert stack is not None
    manager = LoRAManager(model, max_loras=2, max_rank=8, dtype=model.dtype, compiled=False)
    gen = torch.Generator().manual_seed(1)
    for layer in manager.layers.values():
        random_slots(layer, [0, 1], 8, gen)
    used: list[bool] = []
    real = decode_stack_module.DecodeStack.forward

    def counted(self, hidden, *args):
        used.append(self.lora_rows is not None and self.lora_rows.slots is not None)
        return real(self, hidden, *args)

    monkeypatch.setattr(decode_stack_module.DecodeStack, "forward", counted)
    # The same steps with the stack (LoRA in C++), without (LoRALinear), and without adapters.
    on_stack, on_layers, plain = (PagedDriver(model, seed=2, backend="cpu") for _ in range(3))
    seq_slots = [0, NO_SLOT, 1, 0]
    prompts = [torch.randint(5, 128, (n,), generator=gen).tolist() for n in (9, 5, 12, 3)]
    chunks = list(enumerate(prompts))
    tol = TOLERANCE[model.dtype]
    for step in range(4):
        rows = torch.tensor([s for s, (_, t) in zip(seq_slots, chunks, strict=True) for _ in t])
        manager.batch.set(rows)
        model.decode_stack = stack
        got = on_stack.step(chunks)
        model.decode_stack = None
        want = on_layers.step(chunks)
        manager.batch.set(None)
        model.decode_stack = stack
        base = plain.step(chunks)
        for seq, (g, w, b) in enumerate(zip(got, want, base, strict=True)):
            if seq_slots[seq] == NO_SLOT:
                assert torch.equal(g, b), f"step {step}: a base row's logits changed"
            else:
                torch.testing.assert_close(g.float(), w.float(), atol=tol * 10, rtol=tol)
                assert not torch.allclose(g.float(), b.float(), atol=tol * 10, rtol=tol)
        chunks = [(s, [int(w[-1].argmax())]) for s, w in enumerate(want)]
    # Prefill runs the layers; each decode step the stack, with the LoRA rows, then without.
    assert used == [True, False] * 3
