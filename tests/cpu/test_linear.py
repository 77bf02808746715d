"""Linear kernels (pagedattn.cpu.linear) compute what F.linear computes, for any batch size."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from pagedattn.cpu.extension import flush_denormals_all_threads
from pagedattn.cpu.linear import (
    LINEAR_KERNELS,
    fitted_kernel,
    get_kernel,
    kernel_available,
    pack_amx,
    pack_dpbf16,
    pack_panels,
    pack_weight,
    quantize_int8,
)
from pagedattn.model.layers import Linear, LinearKernels
from pagedattn.model.loader import load_model
from tests.model.tiny import make_tiny_llama

needs_panels = pytest.mark.skipif(
    not kernel_available("panels", torch.float32), reason="no vectorized panel GEMM in this build"
)
needs_mkl = pytest.mark.skipif(
    not kernel_available("mkl", torch.float32), reason="torch built without MKL"
)
needs_dpbf16 = pytest.mark.skipif(
    not kernel_available("dpbf16", torch.bfloat16), reason="no AVX512-BF16 in this build"
)
needs_amx = pytest.mark.skipif(
    not kernel_available("amx", torch.bfloat16), reason="no AMX-BF16 on this CPU"
)


def pack_linear_layers(model: nn.Sequential, kernel: str) -> int:
    """Replace each nn.Linear of ``model`` by our Linear on ``kernel``, packed from the same
    weights; returns how many were packed (not left on F.linear)."""
    count = 0
    for i, m in enumerate(model):
        layer = Linear(
            m.in_features, m.out_features, m.bias is not None, LinearKernels(kernel, kernel)
        )
        layer = layer.to(m.weight.dtype)
        layer.weight.data = m.weight.detach().clone()
        if m.bias is not None:
            layer.bias.data = m.bias.detach().clone()
        layer.process_weights_after_loading()
        count += layer.decode is not None
        model[i] = layer
    return count


def panel_linear(x, panels, out_features, bias):
    """The panel kernel on already packed panels (what a packed Linear calls)."""
    from pagedattn.cpu.linear import PackedLinear

    kernel = get_kernel("panels")
    packed = PackedLinear(kernel, out_features, panels.shape[1], panels, None, bias)
    return kernel.apply(packed, x)


@needs_mkl
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 32, 300])
def test_mkl_packed_linear_matches_f_linear(num_tokens):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 48, bias=False))
    x = torch.randn(num_tokens, 96)
    with torch.no_grad():
        expected = model(x)
        assert pack_linear_layers(model, "mkl") == 2
        assert all(m.decode.name == "mkl" for m in model)
        got = model(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(
    not kernel_available("onednn", torch.float32), reason="torch built without oneDNN"
)
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_packed_linear_matches_f_linear(num_tokens, dtype):
    if not kernel_available("onednn", dtype):
        pytest.skip(f"oneDNN cannot run {dtype} here")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 48, bias=False)).to(dtype)
    x = torch.randn(2, num_tokens, 96, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        assert pack_linear_layers(model, "onednn") == 2
        assert all(m.decode.name == "onednn" and m.weight is None for m in model)
        got = model(x)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@needs_panels
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 12, 13, 32, 150])
@pytest.mark.parametrize("out_features", [7, 32, 45, 96])
def test_panel_linear_matches_f_linear_fp32(num_tokens, out_features):
    # Row counts around the 12-row micro-kernel and the 128-row chunk; columns around a panel.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 72), nn.Linear(72, out_features, bias=False))
    x = torch.randn(3, num_tokens, 40)  # leading dims are kept
    with torch.no_grad():
        expected = model(x)
        assert pack_linear_layers(model, "panels") == 2
        got = model(x)
    assert all(m.weight is None for m in model)  # the panels are the only copy
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_panels
@pytest.mark.parametrize("in_features", [1000, 4096])
def test_panel_linear_over_several_activation_chunks(in_features):
    # Rows are cut into chunks of ~1 MB of activations (252 rows at K=1000, the 128-row floor at
    # K=4096); 600 rows span several chunks with a short last one.
    torch.manual_seed(2)
    w = torch.randn(40, in_features) * 0.03
    x = torch.randn(600, in_features)
    got = panel_linear(x, pack_panels(w), 40, None)
    torch.testing.assert_close(got, x @ w.t(), atol=1e-4, rtol=1e-4)


@needs_panels
def test_panel_linear_bf16_is_a_bf16_gemm_with_fp32_accumulation():
    torch.manual_seed(0)
    w = torch.randn(70, 64).bfloat16()
    bias = torch.randn(70)
    x = torch.randn(9, 64).bfloat16()
    panels = pack_panels(w)
    assert panels.dtype == torch.bfloat16 and panels.shape == (3, 64, 32)
    got = panel_linear(x, panels, 70, bias)
    assert got.dtype == torch.bfloat16
    # Products of bf16 numbers are exact in fp32; the sum runs in fp32, rounded to bf16 once.
    expected = (x.double() @ w.double().t() + bias.double()).bfloat16()
    assert (got.float() - expected.float()).abs().max() <= 2**-7 * expected.float().abs().max()
    assert torch.equal(
        panel_linear(x.float(), panels, 70, bias), panel_linear(x.float(), panels, 70, bias)
    )


@needs_panels
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_bf16_activations_round_once_on_store(weight_dtype):
    # A bf16 x is widened inside the kernel and the fp32 result rounded to bf16 on store: the
    # same numbers as widening in PyTorch, running in fp32 and rounding with .to(bfloat16).
    torch.manual_seed(1)
    panels = pack_panels(torch.randn(100, 48).to(weight_dtype))
    x = torch.randn(3, 13, 48).bfloat16()
    got = panel_linear(x, panels, 100, None)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 13, 100)
    assert torch.equal(got, panel_linear(x.float(), panels, 100, None).bfloat16())


@needs_panels
def test_panels_interleave_bf16_halves():
    w = torch.arange(32 * 2, dtype=torch.float32).view(32, 2).bfloat16()  # w[n, k] = 2n + k
    panels = pack_panels(w)  # [1, 2, 32]
    assert panels[0, 0, 0].item() == 0 and panels[0, 0, 1].item() == 32  # columns 0 and 16
    assert panels[0, 1, 2].item() == 3  # column 1, k=1
    assert torch.equal(pack_panels(w.float())[0, 1, :4], torch.tensor([1.0, 3.0, 5.0, 7.0]))


def test_dpbf16_packing_puts_each_columns_k_pair_side_by_side():
    w = torch.arange(40 * 4, dtype=torch.float32).view(40, 4).bfloat16()  # w[n, k] = 4n + k
    panels = pack_dpbf16(w)  # [2, 2, 32, 2]
    assert panels.shape == (2, 2, 32, 2)
    assert panels[0, 0, 0].tolist() == [0, 1] and panels[0, 0, 1].tolist() == [4, 5]
    assert panels[0, 1, 3].tolist() == [14, 15]  # column 3, k pair 1
    assert panels[1, 0, 7].tolist() == [156, 157] and not panels[1, :, 8:].any()  # padding


@needs_dpbf16
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 5, 12, 13, 16, 33, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(70, 64), (32, 2), (200, 1030)])
def test_dpbf16_linear_is_a_bf16_gemm_with_fp32_sums(num_tokens, out_features, in_features):
    # Pairs of bf16 products (exact in fp32) added into fp32 sums, rounded to bf16 once: within
    # a bf16 rounding of the exact product, every row count (1 row: two panels at a time; 13:
    # blocks of 7 and 6; 300: several 12-row blocks; 0: an empty result) and ragged panels.
    torch.manual_seed(num_tokens)
    w = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features)
    x = torch.randn(num_tokens, in_features).bfloat16()
    got = pack_weight("dpbf16", w, bias)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, out_features)
    exact = x.double() @ w.double().t() + bias.double()
    assert torch.allclose(got.double(), exact, rtol=2**-8, atol=1e-3 * in_features**0.5)
    # Each row's sums do not depend on the rows beside it.
    if num_tokens > 1:
        alone = pack_weight("dpbf16", w, bias)(x[-1:])
        assert torch.equal(got[-1:], alone)


@needs_dpbf16
def test_dpbf16_layers_hold_only_the_panels():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 33, bias=False)).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    expected = model(x)
    assert pack_linear_layers(model, "dpbf16") == 2
    assert all(m.weight is None for m in model)
    assert torch.allclose(model(x).float(), expected.float(), rtol=2**-6, atol=2e-2)
    assert fitted_kernel(torch.zeros(8, 7, dtype=torch.bfloat16), "dpbf16") == "torch"  # odd K


def test_kernel_registry_names_every_kernel_and_refuses_unknown_ones():
    assert set(LINEAR_KERNELS) == {
        "panels",
        "dpbf16",
        "amx",
        "mkl",
        "onednn",
        "torch",
        "int8",
        "int8_amx",
        "gguf",
    }
    assert len({k.cpp_id for k in LINEAR_KERNELS.values()}) == len(LINEAR_KERNELS)
    with pytest.raises(ValueError, match="linear kernel 'fast' is invalid"):
        get_kernel("fast")
    assert kernel_available("torch", torch.float16)


def test_float16_layers_run_on_f_linear():
    model = nn.Sequential(nn.Linear(16, 16)).half()
    assert fitted_kernel(model[0].weight, "panels") == "torch"
    assert pack_linear_layers(model, "mkl") == 0
    assert model[0].weight.shape == (16, 16)


def test_flush_denormals_reaches_the_worker_threads():
    assert flush_denormals_all_threads()
    x = torch.full((1 << 20,), 1e-39)  # a denormal float32, large enough to run in parallel
    # An intra-op parallel kernel: every thread must now treat denormal inputs as zero.
    assert torch.count_nonzero(x * 1.0).item() == 0


# A fresh process (the allocator's thresholds adapt to what a process has freed before): one
# 24 MB tensor, allocated, written and freed, then a 24 MB malloc block, and glibc's counters of
# mmapped and heap bytes.
_HEAP_PROBE = """
import ctypes, json, sys
import torch
from pagedattn.cpu.extension import keep_freed_heap_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
kept = keep_freed_heap_memory() if sys.argv[1] == "keep" else None
before = mallinfo2()
x = torch.empty(24 << 20, dtype=torch.uint8)
x.fill_(1)
during = mallinfo2()
del x
after = mallinfo2()
# The same straight through malloc, with no Python object allocated in between: the freed block
# borders the heap's top, which glibc trims by default.
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
block = libc.malloc(24 << 20)
ctypes.memset(block, 1, 24 << 20)
held = mallinfo2()
libc.free(block)
freed = mallinfo2()
print(json.dumps({"kept": kept, "mmapped": during.hblkhd - before.hblkhd,
                  "heap": [before.arena, during.arena, after.arena],
                  "top": [held.arena, freed.arena]}))
"""


def _heap_probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


def test_keep_freed_heap_memory_serves_step_tensors_from_the_heap_and_keeps_them():
    # NOTE: this used to count page faults on a second 6 MB tensor, which was flaky: glibc's own
    # adaptive thresholds also stop the faults after a few rounds, and small allocations made in
    # between sometimes split the freed chunk, so the second tensor landed on fresh pages.
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc (2.33 or later)")
    default = _heap_probe("default")
    # glibc's default: a fresh mmap per large tensor, unmapped (and faulted in again) each time.
    assert default["mmapped"] >= 24 << 20
    kept = _heap_probe("keep")
    assert kept["kept"] is True
    assert kept["mmapped"] == 0  # from the heap
    before, during, after = kept["heap"]
    assert during - before >= 24 << 20
    assert after == during  # freed, but not given back: the next step reuses the pages
    held, freed = kept["top"]
    assert freed == held  # not even from the heap's top


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_compute_the_dequantised_product(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 160), nn.Linear(160, 48, bias=False)).to(dtype)
    first = model[0]
    q, scales = quantize_int8(first.weight.detach())
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scales.shape == (160,)
    dequantised = q.float() * scales.float()[:, None]
    # Rounding to the nearest step of max|w| / 127 per row: at most half a step off (plus, in
    # bf16, the scale's own rounding: 2^-9 of it, times up to 127 steps).
    err = (dequantised - first.weight.float()).abs().max(dim=1).values
    slack = 0.0 if dtype == torch.float32 else 127 * 2**-9
    assert torch.all(err <= scales.float() * (0.5 + slack) + 1e-6)
    x = torch.randn(5, 96, dtype=dtype)
    with torch.no_grad():
        expected = (x.float() @ dequantised.t() + first.bias.float()).to(dtype)
        assert pack_linear_layers(model, "int8") == 2
        assert model[0].decode.name == "int8"
        got = model[0](x)
        assert model(torch.randn(2, 3, 96, dtype=dtype)).shape == (2, 3, 48)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def test_amx_packing_puts_k_pairs_side_by_side():
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).to(torch.bfloat16)
    tiles = pack_amx(w)  # [N / 16, K / 32, 16 k pairs, 16 columns, 2]
    assert tiles.shape == (2, 2, 16, 16, 2)
    for n_block, k_block, r, c, p in [(0, 0, 0, 0, 0), (1, 0, 3, 5, 1), (0, 1, 15, 15, 1)]:
        expected = w[16 * n_block + c, 32 * k_block + 2 * r + p]
        assert tiles[n_block, k_block, r, c, p] == expected


@needs_amx
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 3, 15, 16, 17, 32, 33, 70])
# An odd and an even number of 16-column blocks; 13 blocks are one 8-block dot-product item (1-2
# rows) and a tail of 4 + 1.
@pytest.mark.parametrize("out_features", [48, 64, 208])
def test_amx_linear_is_a_bf16_gemm_with_fp32_accumulation(num_tokens, out_features):
    torch.manual_seed(0)
    w = torch.randn(out_features, 96).to(torch.bfloat16)
    x = torch.randn(num_tokens, 96).to(torch.bfloat16)
    bias = torch.randn(out_features)
    got = pack_weight("amx", w, bias)(x)
    exact = x.double() @ w.double().T + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, out_features)
    # fp32 sums in another order, then one rounding to bf16 (a relative step of 2^-8).
    err = (got.double() - exact).abs()
    assert bool((err <= exact.abs() * 2**-8 + 1e-3).all()), float(err.max())


@needs_amx
@pytest.mark.parametrize("kernel", ["amx", "int8_amx"])
def test_amx_linear_runs_prefill_rows_in_row_blocks_with_the_same_sums(kernel):
    # K = 2,048 bf16 values make 4 KiB rows: a row block is 128 rows, so 300 rows are three
    # blocks, the last one partial (44 rows: one whole 32-row chunk and 12 rows).
    torch.manual_seed(0)
    w = torch.randn(80, 2048).to(torch.bfloat16)
    x = torch.randn(300, 2048).to(torch.bfloat16)
    bias = torch.randn(80)
    layer = pack_weight(kernel, w, bias)
    got = layer(x)
    if kernel == "amx":
        exact = x.double() @ w.double().T + bias.double()
        err = (got.double() - exact).abs()
        assert bool((err <= exact.abs() * 2**-8 + 1e-2).all()), float(err.max())
    # Every row's sums run in the same order whichever block holds it: bit for bit equal to
    # the same rows run alone.
    for start, stop in [(0, 128), (128, 256), (256, 288), (288, 300), (120, 140)]:
        assert torch.equal(got[start:stop], layer(x[start:stop])), (start, stop)


@needs_amx
def test_amx_layers_fall_back_where_the_tiles_do_not_fit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40)).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        assert pack_linear_layers(model, "amx") == 1  # 40 outputs: not whole 16-column tiles
        assert model[0].decode.name == "amx"
        got = model(x)
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


@needs_amx
def test_int8_layers_stay_int8_where_the_tiles_do_not_fit():
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 40)).to(torch.bfloat16)
    assert pack_linear_layers(model, "int8_amx") == 2
    assert [m.decode.name for m in model] == ["int8_amx", "int8"]


@needs_amx
@pytest.mark.parametrize(
    ("kernel", "quantization", "head"), [("amx", None, None), ("int8_amx", "int8", "int8")]
)
def test_lm_head_that_is_not_whole_tiles_falls_back(tmp_path, kernel, quantization, head):
    # A 120-token vocabulary: the LM head is not whole 16-column tiles (it used to fail to pack).
    path = make_tiny_llama(tmp_path, vocab_size=120)
    model = load_model(str(path), "bfloat16", "cpu", "cpu", kernel, quantization).model
    assert model.model.layers[0].mlp.down_proj.decode.name == kernel
    assert (model.lm_head.decode and model.lm_head.decode.name) == head
    hidden = torch.randn(3, model.model.embed_tokens.weight.shape[1], dtype=torch.bfloat16)
    assert model.compute_logits(hidden).shape == (3, 120)


@needs_amx
@pytest.mark.parametrize("num_tokens", [1, 17, 40])
def test_int8_weights_on_amx_compute_what_the_int8_kernel_computes(num_tokens):
    torch.manual_seed(0)
    w = torch.randn(48, 96).to(torch.bfloat16)
    bias = torch.randn(48).to(torch.bfloat16)
    x = torch.randn(num_tokens, 96).to(torch.bfloat16)
    amx = pack_weight("int8_amx", w, bias)
    assert amx.a.dtype == torch.int8 and amx.a.shape == (3, 3, 16, 16, 2)
    reference = pack_weight("int8", w, bias)  # torch's weight-only int8 kernel
    assert torch.equal(amx.b, reference.b.float())  # the very same int8 weights
    # The dequantised weights times x, summed exactly, then one bf16 rounding (ours) against
    # torch's kernel: both within bf16 steps of the exact product of the same int8 weights.
    q, scales = quantize_int8(w)
    exact = x.double() @ (q.double() * scales.double()[:, None]).T + bias.double()
    got = amx(x)
    assert got.dtype == torch.bfloat16
    err = (got.double() - exact).abs()
    assert bool((err <= exact.abs() * 2**-7 + 1e-2).all()), float(err.max())
    torch.testing.assert_close(got.float(), reference(x).float(), atol=5e-2, rtol=2e-2)
