"""--quantization q8_0|q4_0|q4_k on HF checkpoints (GGUF blocks made at load), and GGUF blocks cut
into tensor-parallel shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedattn.cpu import extension
from pagedattn.cpu.plan import KernelChoiceError, KernelOptions
from pagedattn.model import load_model
from pagedattn.model.gguf_loader import GGUFCheckpoint
from pagedattn.model.layers import Linear
from pagedattn.model.loader import checkpoint_config
from tests.model.gguf_writer import write_gguf
from tests.model.paged_driver import PagedDriver
from tests.model.tiny import make_tiny_llama

pytestmark = pytest.mark.skipif(
    extension.get_extension() is None, reason="the gguf kernel needs the compiled extension"
)


@pytest.fixture(scope="module")
def tiny_256(tmp_path_factory) -> Path:
    """A tiny Llama whose projections take whole 256-value blocks (Q4_K)."""
    return make_tiny_llama(
        tmp_path_factory.mktemp("q"),
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        max_position_embeddings=2048,  # room for a prompt as long as any measured tile switch
    )


def dequantised(linear: Linear) -> torch.Tensor:
    """The float weight a gguf-packed layer computes with (its parts in place)."""
    return linear.decode.a.rows(torch.arange(linear.out_features), torch.float32)


@pytest.mark.parametrize(("kind", "weight_error"), [("q8_0", 0.01), ("q4_0", 0.15), ("q4_k", 0.15)])
def test_hf_checkpoint_quantised_at_load(tiny_256, kind, weight_error, capsys):
    """The projections, LM head and embedding become ``kind`` blocks close to the weights,
    and the model computes what a float model with those dequantised weights computes."""
    ref = load_model(str(tiny_256), "float32", "cpu", "torch", linear_kernel="torch")
    quant = load_model(str(tiny_256), "float32", "cpu", "torch", quantization=kind)
    assert f"[weights] {kind.upper()} x 16" in capsys.readouterr().err  # 14 projections + 2
    assert quant.plan.quantize_to == kind
    ref_modules = dict(ref.model.named_modules())
    for name, module in quant.model.named_modules():
        if isinstance(module, Linear):
            assert module.decode.name == "gguf" and module.weight is None
            assert {p.name for p in module.decode.b.parts} == {kind.upper()}
            w, target = dequantised(module), ref_modules[name].weight
            assert ((w - target).norm() / target.norm()).item() < weight_error
            target.data.copy_(w)  # the reference now holds exactly the blocks' values
    table = quant.model.model.embed_tokens.quantized
    assert table.name == kind.upper()
    embed = quant.model.model.embed_tokens
    if embed.lookup is None:
        ref.model.model.embed_tokens.weight.data.copy_(table.dequantize())
    else:  # a tied head packed the table: its blocks live in that layer
        ids = torch.arange(embed.num_embeddings)
        ref.model.model.embed_tokens.weight.data.copy_(embed.lookup.rows(ids, torch.float32))
    # As long as the plan's switch to dequantised tiles (measured on this machine), and short:
    # both paths multiply int8 activations (as llama.cpp does), so close, not equal.
    prompt = [3 + i % 37 for i in range(max(37, quant.plan.quant_prefill_rows))]
    for tokens in (prompt, prompt[:5]):
        a = PagedDriver(quant.model, block_size=16).step([(0, tokens)])[0]
        b = PagedDriver(ref.model, block_size=16).step([(0, tokens)])[0]
        assert ((a - b).norm() / b.norm()).item() < 0.05


def test_dense_weights_option_conflicts():
    with pytest.raises(ValueError, match="dequantize"):
        KernelOptions(quantization="q8_0", weights="dequantize")
    with pytest.raises(ValueError, match="weights='bf16' is invalid"):
        KernelOptions(weights="bf16")


def test_quantization_without_the_kernels_is_refused(monkeypatch):
    from pagedattn.cpu import plan as plan_module

    monkeypatch.setattr(plan_module, "kernel_available", lambda name, dtype: False)
    with pytest.raises(KernelChoiceError, match="compiled GGUF kernels"):
        plan_module.choose_plan(
            plan_module.ModelShapes(((64, 64),), (128, 64), 4, 2, 16),
            torch.float32,
            KernelOptions(quantization="q8_0"),
        )


def test_blocks_narrow_to_a_shard_by_rows_and_by_whole_blocks_of_columns(tmp_path):
    """Head-aligned rows of llama.cpp's permuted Q rows are a view of the stored rows and
    dequantise to the weight's rows; columns come in whole blocks and refuse to split one."""
    hf_dir = make_tiny_llama(tmp_path, hidden_size=64, head_dim=16)
    path = write_gguf(hf_dir, tmp_path / "tiny.gguf", "llama", q8_0=True)
    checkpoint = GGUFCheckpoint(path)
    config = checkpoint_config(checkpoint)
    weights = dict(checkpoint.quantized_weights(config, torch.float32))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.row_order is not None
    full = q.dequantize()
    rows = q.narrow(0, 32, 32)  # heads 2 and 3 of 16 rows
    assert rows.data.data_ptr() == q.data[32].data_ptr()  # a view: nothing copied
    assert torch.equal(rows.dequantize(), full[32:64])
    cols = q.narrow(1, 32, 32)
    assert torch.equal(cols.dequantize(), full[:, 32:64])
    with pytest.raises(ValueError, match="Q8_0 blocks hold 32 columns"):
        q.narrow(1, 16, 32)
    table = weights["model.embed_tokens.weight"]
    padded = table.narrow(0, 100, 28).padded(64)
    assert torch.equal(padded.dequantize()[:28], table.dequantize()[100:])
    assert not padded.dequantize()[28:].any()
