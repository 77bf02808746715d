"""The MoE block against a per-expert reference (and HF's block) on random data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedattn.model.moe import MoESpec, SparseMoEBlock, grouped_moe, route


def _reference(x, gate_up, down, weights, ids):
    """Each token through each of its experts, one at a time, weighted and summed."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e].float() @ x[t].float()).chunk(2)
            out[t] += weights[t, j] * (down[e].float() @ (F.silu(gate) * up))
    return out


def _experts(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return gate_up.to(dtype), down.to(dtype)


@pytest.mark.parametrize("step_ops", [True, False])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_grouped_moe_matches_per_expert_reference(num_tokens, dtype, tol, step_ops):
    num_experts, top_k, hidden, inter = 8, 3, 64, 48
    gate_up, down = _experts(num_experts, hidden, inter, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    weights, ids = route(logits, top_k, renormalize=True)
    out = grouped_moe(x, gate_up, down, weights, ids, step_ops)
    assert out.dtype == dtype and out.shape == x.shape
    ref = _reference(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, probs[:, :2])
    w, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1))


def test_batch_one_reads_only_the_chosen_experts():
    """Inactive experts' weights are NaN: the output stays finite only if they are never read."""
    gate_up, down = _experts(8, 32, 16, torch.float32)
    x = torch.randn(1, 32)
    ids = torch.tensor([[5, 2]])
    weights = torch.tensor([[0.7, 0.3]])
    ref = grouped_moe(x, gate_up, down, weights, ids)
    inactive = [e for e in range(8) if e not in (5, 2)]
    gate_up[inactive] = float("nan")
    down[inactive] = float("nan")
    out = grouped_moe(x, gate_up, down, weights, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_block_matches_hf_qwen3_moe_block(norm_topk_prob):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=norm_topk_prob,
    )
    torch.manual_seed(0)
    hf = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    ours = SparseMoEBlock(32, MoESpec(6, 2, 24, renormalize=norm_topk_prob))
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    x = torch.randn(1, 10, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_match_stacked(dtype):
    """Experts packed for a compiled linear kernel give the stacked weights' output."""
    from pagedattn.cpu.linear import kernel_available

    if not kernel_available("panels", dtype):
        pytest.skip("the panels kernel is not built here")
    spec = MoESpec(8, 2, 48, renormalize=True)
    plain = SparseMoEBlock(64, spec).to(dtype)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    packed = SparseMoEBlock(64, spec, kernel="panels").to(dtype)
    packed.load_state_dict(plain.state_dict())
    packed.process_weights_after_loading()
    assert packed.packed is not None and packed.packed[0][0].name == "panels"
    assert packed.router is not None and packed.router.name == "panels"
    assert packed.experts.gate_up_proj.numel() == 0  # the stacked copy is freed
    x = torch.randn(9, 64).to(dtype)
    with torch.no_grad():
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(packed(x), plain(x), rtol=tol, atol=tol)
