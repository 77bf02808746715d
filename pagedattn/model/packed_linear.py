"""Linear layers on CPU through weights packed once at load, one kernel per regime.

Kernels (``KERNELS``):

- ``panels``: the AVX-512 panel GEMM of ``pagedattn/csrc/linear_cpu.cpp``: each weight stored as
  k-major panels of 32 output columns in its own dtype (bf16 widened to fp32 in registers), sums
  in fp32; bf16 activations are widened and the result rounded back once. Fastest at decode
  batch sizes without AMX; slow at prefill row counts in bf16.
- ``amx``: the AMX-BF16 tile GEMM of ``pagedattn/csrc/linear_amx_cpu.cpp`` (bf16 only, CPUs with
  AMX): weights packed once into the tiles' own layout and streamed once per call. At decode row
  counts it ran the SmolLM2 matmuls in about half of oneDNN's time on the AMX machine.
- ``mkl``: MKL's packed sgemm (float32 only).
- ``onednn``: oneDNN's inner product with the weight reordered once at load
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``); on a CPU with AMX a bf16
  GEMM runs on the tiles (``brg_matmul:avx10_1_512_amx`` in ONEDNN_VERBOSE).
- ``torch``: plain ``F.linear``.
- ``int8`` (``--quantization int8``, never picked by the tuner for unquantized models):
  per-output-channel symmetric int8 weights (scale = max |w| / 127) through torch's weight-only
  ``_weight_int8pack_mm``; activations stay in the model's dtype. Half the weight bytes of bf16.
- ``int8_amx``: the same int8 weights in the AMX kernel's tile layout, each tile widened to bf16
  in L1 just before its tile product and the scale applied to the fp32 sums (bf16 models on a
  CPU with AMX). The tuner measures it against ``int8`` for ``--quantization int8``.

A ``LinearPlan`` names one kernel for few rows (decode) and one for many (prefill), split at
``prefill_rows``, and one for the LM head; ``pagedattn.model.kernel_tuner`` picks it by measuring
on the model's shapes. ``PAGEDATTN_LINEAR=<kernel>`` forces one kernel everywhere.
"""

from __future__ import annotations

import os
import types
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.cpu import extension as cpu_ext

KERNEL_ENV = "PAGEDATTN_LINEAR"
KERNELS = ("panels", "amx", "mkl", "onednn", "torch")
# Weight quantizations (not tuned: they change the numbers); see PackedLinear.
QUANTIZATIONS = ("int8",)
# The kernels that run int8 weights (the same numbers, up to the order of the sums); the kernel
# tuner measures them for a model loaded with quantization="int8".
INT8_KERNELS = ("int8", "int8_amx")
INT8_MAX = 127
AUTO = "auto"
PANEL = 32  # output columns per panel (the C++ kernel's kPanel)
# The AMX kernel's tile: 16 output columns by 32 k values (16 k pairs, VNNI order).
AMX_TILE_N, AMX_TILE_K = 16, 32
# The batch size MKL tunes its packed layout for; any batch size works with it.
PACK_BATCH_HINT = 32
# Rows at and above which a layer runs its prefill kernel when the plan names no split.
DEFAULT_PREFILL_ROWS = 128


class LinearPlan(NamedTuple):
    """Kernel for fewer than ``prefill_rows`` rows, kernel for more, and the LM head's kernel;
    the decode attention kernel and the thread count the kernel tuner measured as fastest."""

    decode: str
    prefill: str
    head: str
    prefill_rows: int = DEFAULT_PREFILL_ROWS
    # decode attention: the extension's kernel, its AMX tiles path ("amx"), or "torch"
    attention: str = "compiled"
    threads: int = 0  # torch threads to run on; 0: as configured (nothing measured)

    @classmethod
    def single(cls, kernel: str) -> LinearPlan:
        return cls(kernel, kernel, kernel)

    def describe(self) -> str:
        if self.decode == self.prefill == self.head:
            text = f"linear {self.decode}"
        else:
            text = (
                f"linear decode {self.decode}, prefill {self.prefill} (>= {self.prefill_rows} "
                f"rows), LM head {self.head}"
            )
        if self.attention != "compiled":
            text += f", decode attention {self.attention}"
        if self.threads:
            text += f", {self.threads} thread{'s' if self.threads > 1 else ''}"
        return text


def mkl_packing_available() -> bool:
    """True when this torch build has MKL's packed linear ops."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def panel_kernel_available() -> bool:
    """True when the compiled extension with the AVX-512 panel GEMM is loaded."""
    ext = cpu_ext.get_extension()
    return ext is not None and ext.linear_packed_vectorized()


def onednn_available(dtype: torch.dtype) -> bool:
    """True when torch's oneDNN packed linear ops run ``dtype`` on this CPU."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def kernel_available(kernel: str, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` can run a CPU linear layer in ``dtype`` here."""
    if kernel == "torch":
        return True
    if kernel == "panels":
        return dtype in (torch.float32, torch.bfloat16) and panel_kernel_available()
    if kernel in ("amx", "int8_amx"):
        return dtype == torch.bfloat16 and cpu_ext.amx_available()
    if kernel == "mkl":
        return dtype == torch.float32 and mkl_packing_available()
    if kernel == "onednn":
        return onednn_available(dtype)
    if kernel == "int8":
        return hasattr(torch.ops.aten, "_weight_int8pack_mm")
    return False


def usable_plan(plan: LinearPlan, dtype: torch.dtype) -> LinearPlan:
    """``plan`` with each kernel that cannot run ``dtype`` here replaced by torch."""
    for kernel in plan[:3]:
        if kernel not in (*KERNELS, *INT8_KERNELS):
            raise ValueError(
                f"linear kernel {kernel!r} is invalid: use one of {', '.join((AUTO, *KERNELS))}"
            )
    decode, prefill, head = (k if kernel_available(k, dtype) else "torch" for k in plan[:3])
    return plan._replace(decode=decode, prefill=prefill, head=head)


def forced_kernel() -> str | None:
    """The kernel PAGEDATTN_LINEAR forces, or None when unset or ``auto``."""
    chosen = os.environ.get(KERNEL_ENV, "").strip().lower()
    if not chosen or chosen == AUTO:
        return None
    if chosen not in KERNELS:
        raise ValueError(
            f"{KERNEL_ENV}={chosen!r} is invalid: use one of {', '.join((AUTO, *KERNELS))}"
        )
    return chosen


def linear_kernel() -> str:
    """The kernel used without a measured plan: PAGEDATTN_LINEAR, else panels, MKL, torch."""
    chosen = forced_kernel()
    if chosen:
        return chosen
    if panel_kernel_available():
        return "panels"
    return "mkl" if mkl_packing_available() else "torch"


# Kernels.


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


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weight (N % 16 == 0, K % 32 == 0) -> [N / 16, K / 32, 16, 16, 2] AMX tiles.

    Tile (n, k) row r, column c holds W[16n + c, 32k + 2r] and W[16n + c, 32k + 2r + 1]: the
    layout TDPBF16PS reads its second operand in; a block's tiles are contiguous along K.
    """
    n, k = weight.shape
    tiles = weight.reshape(n // AMX_TILE_N, AMX_TILE_N, k // AMX_TILE_K, AMX_TILE_K // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def amx_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear`` through AMX-packed tiles; x [..., K] -> [..., out_features] in bf16.

    ``packed``: bf16 tiles, or int8 tiles with their float32 per-column ``scales``. ``bias``
    must be float32 (added in fp32 before the one rounding to bf16).
    """
    ext = cpu_ext.load_extension()
    in_features = packed.shape[1] * AMX_TILE_K
    x2 = x.reshape(-1, in_features).to(torch.bfloat16).contiguous()  # [M, K]
    out = ext.linear_amx(x2, packed, out_features, bias, scales)  # [M, N]
    return out.reshape(*x.shape[:-1], out_features)


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


def pack_onednn(weight: torch.Tensor, batch_hint: int | None = None) -> torch.Tensor:
    """Reorder a [out, in] weight into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)


def onednn_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` through a oneDNN-packed weight; x [..., in] -> [..., out] (weight's dtype)."""
    x2 = x.reshape(-1, packed.shape[1])  # [M, in]
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], out_features, dtype=packed.dtype)
    if x2.dtype != packed.dtype:
        x2 = x2.to(packed.dtype)
    out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)  # [..., out]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (int8 [N, K], scales [N] in the weight's dtype), per output channel."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # [N]
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] @ (q * scales).T (+ bias) -> [..., N] in the scales' dtype."""
    x2 = x.reshape(-1, q.shape[1]).to(scales.dtype).contiguous()  # [M, K]
    out = torch.ops.aten._weight_int8pack_mm(x2, q, scales)  # [M, N]
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], q.shape[0])


class PackedLinear:
    """One [out, in] weight (and bias) packed for one kernel; calling it computes F.linear."""

    def __init__(self, kernel: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.weight = weight if kernel in ("mkl", "torch") else None
        self.bias = bias
        self.packed: torch.Tensor | None = None
        if kernel == "panels":
            self.packed = pack_panels(weight)
            self.bias = None if bias is None else bias.float().contiguous()
        elif kernel == "amx":
            self.packed = pack_amx(weight)
            self.bias = None if bias is None else bias.float().contiguous()
        elif kernel == "mkl":
            self.packed = pack_weight(weight)
        elif kernel == "onednn":
            self.packed = pack_onednn(weight)
            self.bias = None if bias is None else bias.to(weight.dtype).contiguous()
        elif kernel == "int8":
            self.packed, self.scales = quantize_int8(weight)
            self.bias = None if bias is None else bias.to(weight.dtype).contiguous()
        elif kernel == "int8_amx":
            q, scales = quantize_int8(weight)
            self.packed, self.scales = pack_amx(q), scales.float().contiguous()
            self.bias = None if bias is None else bias.float().contiguous()
        elif kernel != "torch":
            raise ValueError(
                f"linear kernel {kernel!r} is invalid: use one of {', '.join(KERNELS)}"
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "panels":
            return panel_linear(x, self.packed, self.out_features, self.bias)
        if self.kernel == "amx":
            return amx_linear(x, self.packed, self.out_features, self.bias)
        if self.kernel == "mkl":
            return packed_linear(x, self.packed, self.weight, self.bias)
        if self.kernel == "onednn":
            return onednn_linear(x, self.packed, self.out_features, self.bias)
        if self.kernel == "int8":
            return int8_linear(x, self.packed, self.scales, self.bias)
        if self.kernel == "int8_amx":
            return amx_linear(x, self.packed, self.out_features, self.bias, self.scales)
        return F.linear(x, self.weight, self.bias)


# Model-wide switch.


def packable(weight: torch.Tensor | None, kernel: str) -> bool:
    """Whether ``weight`` can run on ``kernel`` (a CPU weight of a dtype the kernel takes)."""
    if weight is None or weight.device.type != "cpu" or weight.numel() == 0:
        return False
    if kernel == "panels":
        return weight.dtype in (torch.float32, torch.bfloat16)
    if kernel in ("amx", "int8_amx"):
        n, k = weight.shape
        return weight.dtype == torch.bfloat16 and n % AMX_TILE_N == 0 and k % AMX_TILE_K == 0
    if kernel == "mkl":
        return weight.dtype == torch.float32
    if kernel == "onednn":
        return weight.dtype in (torch.float32, torch.bfloat16)
    if kernel == "int8":
        return weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return kernel == "torch"


def fitted_kernel(weight: torch.Tensor, kernel: str) -> str:
    """``kernel`` if it can run ``weight``, else what runs it in its place: int8 weights that are
    not whole AMX tiles stay int8 (torch's kernel), anything else falls back to F.linear."""
    if packable(weight, kernel):
        return kernel
    if kernel == "int8_amx" and packable(weight, "int8"):
        return "int8"
    return "torch"


def _plan_for(weight: torch.Tensor, plan: LinearPlan) -> LinearPlan:
    """``plan`` with every kernel that cannot run ``weight`` replaced (fitted_kernel)."""
    decode, prefill, head = (fitted_kernel(weight, k) for k in plan[:3])
    return plan._replace(decode=decode, prefill=prefill, head=head)


def _dispatch_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // self.in_features if self.in_features else 0
    return (self.linear_prefill if rows >= self.prefill_rows else self.linear_decode)(x)


def pack_linear(module: nn.Linear, plan: LinearPlan) -> bool:
    """Switch one CPU nn.Linear to ``plan``'s decode/prefill kernels; False if it stays as is.

    The layer's own weight is released: the packed copies are the only ones (the torch and MKL
    kernels keep a reference to the original tensor).
    """
    w = module.weight
    if w is None or w.device.type != "cpu" or w.numel() == 0:
        return False
    plan = _plan_for(w.detach(), plan)
    if plan.decode == plan.prefill == "torch":
        return False
    w, b = w.detach(), None if module.bias is None else module.bias.detach()
    module.linear_decode = PackedLinear(plan.decode, w, b)
    module.linear_prefill = (
        module.linear_decode if plan.prefill == plan.decode else PackedLinear(plan.prefill, w, b)
    )
    module.prefill_rows = plan.prefill_rows
    module.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
    module.forward = types.MethodType(_dispatch_forward, module)
    return True


def pack_linear_layers(
    model: nn.Module, kernel: str | LinearPlan | None = None, exclude: tuple[nn.Module, ...] = ()
) -> int:
    """Switch every packable CPU nn.Linear of ``model`` (but ``exclude``) to ``kernel``.

    ``kernel`` is one kernel name for all rows, or a LinearPlan; default ``linear_kernel()``.
    Returns how many layers were switched.
    """
    plan = (
        kernel if isinstance(kernel, LinearPlan) else LinearPlan.single(kernel or linear_kernel())
    )
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and not any(module is e for e in exclude):
            count += pack_linear(module, plan)
    return count
