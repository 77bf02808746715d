"""The fused MoE block (csrc/moe_cpu.cpp) against a per-expert reference: packed float experts
and experts stored as GGUF blocks, decode and prefill row counts, both thread layouts.

tests/cpu/test_kernels_per_isa.py runs this module at every ISA level the CPU executes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedattn.cpu import extension
from pagedattn.cpu.linear import kernel_available
from pagedattn.cpu.quant import quantize
from pagedattn.model.moe import MoESpec, SparseMoEBlock, grouped_moe, route

pytestmark = pytest.mark.skipif(
    extension.get_extension() is None, reason="the C++ extension is not built here"
)

HIDDEN, INTER, EXPERTS, TOP_K = 256, 256, 8, 3


def _reference(x, gate_up, down, weights, ids):
    """Each token through each of its experts one at a time (float32 weights), weighted, summed."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t].float()).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


def _block(dtype, kernel="panels", quant=None, seed=0):
    """A block with random experts packed for ``kernel``, or stored as ``quant`` GGUF blocks;
    returns it with the float32 weights its experts compute with (dequantised for quant)."""
    g = torch.Generator().manual_seed(seed)
    spec = MoESpec(EXPERTS, TOP_K, INTER, renormalize=True)
    block = SparseMoEBlock(HIDDEN, spec, kernel=kernel).to(dtype)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
        if quant is None:
            block.experts.gate_up_proj.copy_(gate_up)
            block.experts.down_proj.copy_(down)
            gate_up, down = gate_up.to(dtype).float(), down.to(dtype).float()
        else:
            gate_up, down = gate_up.clone(), down.clone()
            for e in range(EXPERTS):
                for shard in (0, 1):
                    q = quantize(gate_up[e, shard * INTER : (shard + 1) * INTER], quant)
                    block.quantized[("gate_up_proj", e, shard)] = q
                    gate_up[e, shard * INTER : (shard + 1) * INTER] = q.dequantize()
                q = quantize(down[e], quant)
                block.quantized[("down_proj", e, None)] = q
                down[e] = q.dequantize()
    block.process_weights_after_loading()
    return block, gate_up, down


def _inputs(num_tokens, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(dtype)
    weights, ids = route(torch.randn(num_tokens, EXPERTS, generator=g), TOP_K, True)
    return x, weights, ids


CASES = [
    pytest.param(torch.float32, "panels", None, 1e-5, id="f32-panels"),
    pytest.param(torch.bfloat16, "panels", None, 1e-2, id="bf16-panels"),
    pytest.param(torch.bfloat16, "dpbf16", None, 1e-2, id="bf16-dpbf16"),
    pytest.param(torch.float32, "gguf", "q8_0", 2e-2, id="f32-q8_0"),
    pytest.param(torch.bfloat16, "gguf", "q4_k", 3e-2, id="bf16-q4_k"),
    pytest.param(torch.float32, "gguf", "q4_0", 3e-2, id="f32-q4_0"),
]


@pytest.mark.parametrize("num_tokens", [1, 2, 9, 200])
@pytest.mark.parametrize(("dtype", "kernel", "quant", "tol"), CASES)
def test_fused_block_matches_per_expert_reference(num_tokens, dtype, kernel, quant, tol):
    if not kernel_available(kernel, dtype):
        pytest.skip(f"the {kernel} kernel is not built here")
    block, gate_up, down = _block(dtype, "panels" if quant else kernel, quant=quant)
    assert block.fused is not None
    assert block.packed[0][0].name == (kernel if quant is None else "gguf")
    x, weights, ids = _inputs(num_tokens, dtype)
    out = block.fused.forward(x, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    ref = _reference(x, gate_up, down, weights, ids)
    # NOTE: GGUF experts meet int8 activations (as llama.cpp's): the error of the whole output,
    # relative to its size.
    assert float((out.float() - ref).norm() / ref.norm()) < tol
    # The Python path over the same packed experts computes the same numbers (to a rounding of
    # the dtype: one row through the panels kernel on one thread may pair its panels otherwise).
    same = grouped_moe(x, *block.packed, weights, ids)
    ulp = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out, same, rtol=ulp, atol=ulp * float(same.abs().max()))


@pytest.mark.parametrize(("dtype", "quant"), [(torch.float32, None), (torch.bfloat16, "q4_k")])
def test_thread_layouts_agree(dtype, quant):
    """Rows of one token each with every expert apart (threads take whole experts) equal those
    rows among many (each expert's linears split across threads); GGUF rows bit for bit."""
    block, *_ = _block(dtype, quant=quant)
    x, weights, ids = _inputs(64, dtype)
    together = block.fused.forward(x, weights, ids)
    alone = torch.cat(
        [block.fused.forward(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(64)]
    )
    tol = 0 if quant else 1e-6
    torch.testing.assert_close(together, alone, rtol=tol, atol=tol)


def test_reads_only_the_chosen_experts():
    """Inactive experts' weights are NaN: the output stays finite only if they are never read."""
    spec = MoESpec(EXPERTS, 2, INTER, renormalize=True)
    block = SparseMoEBlock(HIDDEN, spec, kernel="panels")
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
        block.experts.gate_up_proj[[0, 1, 3, 4, 6, 7]] = float("nan")
        block.experts.down_proj[[0, 1, 3, 4, 6, 7]] = float("nan")
    block.process_weights_after_loading()
    x = torch.randn(1, HIDDEN)
    out = block.fused.forward(x, torch.tensor([[0.6, 0.4]]), torch.tensor([[5, 2]]))
    assert torch.isfinite(out).all()


def test_bad_ids_are_refused():
    block, *_ = _block(torch.float32)
    x = torch.randn(1, HIDDEN)
    with pytest.raises(RuntimeError, match="out of range"):
        block.fused.forward(x, torch.ones(1, 1), torch.tensor([[EXPERTS]]))
    with pytest.raises(RuntimeError, match="float32"):
        block.fused.forward(x, torch.ones(1, 1, dtype=torch.float64), torch.tensor([[0]]))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_one_busy_expert_splits_its_own_linears(dtype, tol):
    """Every row on one expert (fewer active experts than threads): that expert's linears split
    across the threads instead, with the same result."""
    block, gate_up, down = _block(dtype)
    x, _, _ = _inputs(50, dtype)
    ids, weights = torch.full((50, 1), 5), torch.full((50, 1), 0.5)
    out = block.fused.forward(x, weights, ids)
    ref = _reference(x, gate_up, down, weights, ids)
    assert float((out.float() - ref).norm() / ref.norm()) < tol
