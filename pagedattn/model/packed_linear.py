"""Linear layers on CPU through weights packed once at load: a panel GEMM, or MKL's packed GEMM.

The panel kernel (``pagedattn/csrc/linear_cpu.cpp``) stores each weight as k-major panels of 32
output columns, in the weight's own dtype (float32, or bfloat16 widened to fp32 in registers),
and sums in fp32. bf16 activations are widened to fp32 before the GEMM and the result rounded
back once, inside the kernel: the semantics of a bf16 GEMM with fp32 accumulation, which is what
oneDNN computes too.

Measured on the 2-core CPU this project targets (``python -m pagedattn.benchmarks.bench_linear``: a
SmolLM2 decode step's matmuls at 32 rows, 30 distinct layers so weights stream from memory, 2
threads): ``F.linear`` 57.8 ms, MKL packed 46.4 ms, fp32 panels 40.8 ms, bf16 panels 33.1 ms; at
128-512 rows (prefill) the panels are as fast as MKL or faster. ``PAGEDATTN_LINEAR=mkl`` or
``=torch`` picks the older paths, for measuring; MKL is also the fallback when the compiled
extension is unavailable.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.attention.backends import cpu_ext

KERNEL_ENV = "PAGEDATTN_LINEAR"
KERNELS = ("panels", "mkl", "torch")
PANEL = 32  # output columns per panel (the C++ kernel's kPanel)
# The batch size MKL tunes its packed layout for; any batch size works with it.
PACK_BATCH_HINT = 32


def mkl_packing_available() -> bool:
    """True when this torch build has MKL's packed linear ops."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def panel_kernel_available() -> bool:
    """True when the compiled extension with the AVX-512 panel GEMM is loaded."""
    ext = cpu_ext.get_extension()
    return ext is not None and ext.linear_packed_vectorized()


def linear_kernel() -> str:
    """The CPU linear kernel to use: PAGEDATTN_LINEAR if set, else panels, else MKL, else torch."""
    chosen = os.environ.get(KERNEL_ENV, "").strip().lower()
    if chosen:
        if chosen not in KERNELS:
            raise ValueError(f"{KERNEL_ENV}={chosen!r} is invalid: use one of {', '.join(KERNELS)}")
        return chosen
    if panel_kernel_available():
        return "panels"
    return "mkl" if mkl_packing_available() else "torch"


# Panels.


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32/bfloat16 weight -> [ceil(N / 32), K, 32] panels in the same dtype.

    Panel p, row k holds W[32p + j, k] for j < 32 (zero past N). bf16 rows are interleaved:
    lane 2j holds column j and lane 2j + 1 column 16 + j, so one 64-byte load yields both halves.
    """
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = torch.zeros(num_panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    panels = padded.view(num_panels, PANEL, k).transpose(1, 2)  # [P, K, 32]
    if weight.dtype == torch.bfloat16:
        half = PANEL // 2
        panels = torch.stack((panels[..., :half], panels[..., half:]), dim=-1)  # [P, K, 16, 2]
        panels = panels.reshape(num_panels, k, PANEL)
    return panels.contiguous()


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` through packed panels; x [..., K] -> [..., out_features] in x's dtype.

    ``bias`` must be float32 (the kernel adds it in fp32 before any rounding).
    """
    ext = cpu_ext.load_extension()
    x2 = x.reshape(-1, panels.shape[1])  # [M, K]
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    out = ext.linear_packed(x2.contiguous(), panels, out_features, bias)  # [M, N] in x2's dtype
    return out.to(x.dtype).reshape(*x.shape[:-1], out_features)


def _panel_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return panel_linear(x, self.panels, self.out_features, self.bias32)


# MKL.


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Reorder a [out, in] float32 weight into MKL's packed GEMM format."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_BATCH_HINT)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the MKL-packed weight; x [..., in] -> [..., out]."""
    x2 = x.reshape(-1, weight.shape[1])  # [N, in]
    if x2.shape[0] == 0:
        return F.linear(x, weight, bias)
    out = torch.ops.mkl._mkl_linear(x2, packed, weight, bias, x2.shape[0])  # [N, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _mkl_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, self.packed_weight, self.weight, self.bias)


# Model-wide switch.


def packable(weight: torch.Tensor | None, kernel: str) -> bool:
    """Whether ``weight`` can run on ``kernel`` (CPU; fp32 or bf16 for panels, fp32 for MKL)."""
    if weight is None or weight.device.type != "cpu":
        return False
    if kernel == "panels":
        return weight.dtype in (torch.float32, torch.bfloat16)
    return kernel == "mkl" and weight.dtype == torch.float32


def pack_linear_layers(model: nn.Module, kernel: str | None = None) -> int:
    """Switch every packable CPU nn.Linear of ``model`` to ``kernel`` (default: linear_kernel()).

    With panels the layer's original weight is released (the panels are the only copy); MKL keeps
    it, as its op wants both. Returns how many layers were switched.
    """
    kernel = kernel or linear_kernel()
    if kernel == "torch":
        return 0
    count = 0
    for module in model.modules():
        w = module.weight if isinstance(module, nn.Linear) else None
        if not packable(w, kernel):
            continue
        if kernel == "panels":
            module.register_buffer("panels", pack_panels(w.detach()), persistent=False)
            bias32 = None if module.bias is None else module.bias.detach().float().contiguous()
            module.register_buffer("bias32", bias32, persistent=False)
            module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
            module.forward = types.MethodType(_panel_forward, module)
        else:
            module.register_buffer("packed_weight", pack_weight(w.detach()), persistent=False)
            module.forward = types.MethodType(_mkl_forward, module)
        count += 1
    return count
