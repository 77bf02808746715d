"""Linear-layer kernels on CPU: one class per kernel, registered by name (as vLLM's MPLinearKernel).

Each kernel says whether it runs in a dtype here (``available``), whether it takes a weight
(``fits``), packs a weight once (``pack``) and computes ``F.linear`` from the packed form
(``apply``). A ``PackedLinear`` is one weight packed for one kernel; the model's ``Linear``
layers hold one for few rows (decode) and one for many (prefill), as the KernelPlan says.

- ``panels``: the panel GEMM of ``csrc/linear_cpu.cpp``: k-major panels of 32 output columns in
  the weight's dtype, fp32 sums (written over at::vec, so it vectorizes on AVX2, AVX-512, NEON).
- ``dpbf16``: bf16 panels of 32 columns by k pairs through AVX512-BF16's dot product
  (``csrc/linear_dpbf16_cpu.cpp``; builds for CPUs that have it: AMD Zen 4 and 5).
- ``amx``: the AMX-BF16 tile GEMM of ``csrc/linear_amx_cpu.cpp`` (bf16, CPUs with AMX).
- ``mkl``: MKL's packed sgemm (float32).
- ``onednn``: oneDNN's inner product on a weight reordered once at load.
- ``torch``: plain ``F.linear``.
- ``int8`` / ``int8_amx`` (``quantization="int8"`` only): per-output-channel symmetric int8
  weights through torch's weight-only kernel, or widened to bf16 tile by tile on AMX.
- ``gguf``: weights kept in GGUF blocks (Q2_K ... IQ4_XS, pagedattn.cpu.quant) through
  ``csrc/quant_cpu.cpp``: int8 dot products on the blocks for decode rows, tiles dequantised
  into at::mm for prefill. Its "weight" is a ``QuantizedParts`` (the pieces of a fused layer).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from pagedattn.cpu import extension
from pagedattn.cpu.quant import QUANTIZE_TYPES, QuantizedTensor

PANEL = 32  # output columns per panel (the C++ kernel's kPanel)
# The AMX kernel's tile: 16 output columns by 32 k values (16 k pairs, VNNI order).
AMX_TILE_N, AMX_TILE_K = 16, 32
# The batch size MKL tunes its packed layout for; any batch size works with it.
PACK_BATCH_HINT = 32
INT8_MAX = 127
FLOAT_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear:
    """One [out, in] weight (and bias) packed for one kernel; calling it computes F.linear."""

    __slots__ = ("kernel", "out_features", "in_features", "a", "b", "bias")

    def __init__(
        self,
        kernel: LinearKernel,
        out_features: int,
        in_features: int,
        a: torch.Tensor,
        b: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        self.kernel = kernel
        self.out_features, self.in_features = out_features, in_features
        self.a, self.b, self.bias = a, b, bias  # the kernel's tensors (see each kernel's pack)

    @property
    def name(self) -> str:
        return self.kernel.name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(self, x)


class LinearKernel:
    """One way to compute ``F.linear`` on CPU; subclasses register themselves by ``name``."""

    name: ClassVar[str]
    cpp_id: ClassVar[int]  # the decode stack's number for this kernel (csrc DecodeLinear)
    quantized: ClassVar[bool] = False
    # Whether its packed form holds the plain weight itself, which F.linear can then run on.
    keeps_weight: ClassVar[bool] = False

    def available(self, dtype: torch.dtype) -> bool:
        """Whether this kernel runs layers in ``dtype`` on this CPU and build."""
        raise NotImplementedError

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether this kernel takes ``weight`` (its dtype and shape)."""
        return weight.dtype in FLOAT_DTYPES

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        raise NotImplementedError

    def apply(self, packed: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _packed(self, weight, a, b=None, bias=None) -> PackedLinear:
        return PackedLinear(self, weight.shape[0], weight.shape[1], a, b, bias)


class TorchLinear(LinearKernel):
    name, cpp_id, keeps_weight = "torch", 0, True

    def available(self, dtype: torch.dtype) -> bool:
        return True

    def fits(self, weight: torch.Tensor) -> bool:
        return True

    def pack(self, weight, bias):
        return self._packed(weight, weight, None, bias)

    def apply(self, packed, x):
        return F.linear(x, packed.a, packed.bias)


def _panel_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight -> [ceil(N / 32), 32, K]: its rows by panel of 32, zero rows past N."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = torch.zeros(num_panels * PANEL, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(num_panels, PANEL, k)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32/bfloat16 weight -> [ceil(N / 32), K, 32] panels in the same dtype.

    Panel p, row k holds W[32p + j, k] for j < 32 (zero past N). bf16 rows are interleaved:
    lane 2j holds column j and lane 2j + 1 column 16 + j, so one 64-byte load yields both halves.
    """
    num_panels, k = -(-weight.shape[0] // PANEL), weight.shape[1]
    panels = _panel_rows(weight).transpose(1, 2)  # [P, K, 32]
    if weight.dtype == torch.bfloat16:
        half = PANEL // 2
        panels = torch.stack((panels[..., :half], panels[..., half:]), dim=-1)  # [P, K, 16, 2]
        panels = panels.reshape(num_panels, k, PANEL)
    return panels.contiguous()


class PanelLinear(LinearKernel):
    name, cpp_id = "panels", 1

    def available(self, dtype):
        ext = extension.get_extension()
        return dtype in FLOAT_DTYPES and ext is not None and ext.linear_packed_vectorized()

    def pack(self, weight, bias):
        fp32_bias = None if bias is None else bias.float().contiguous()
        return self._packed(weight, pack_panels(weight), None, fp32_bias)

    def apply(self, packed, x):
        ext = extension.load_extension()
        x2 = x.reshape(-1, packed.in_features)  # [M, K]
        if x2.dtype not in FLOAT_DTYPES:
            x2 = x2.float()
        out = ext.linear_packed(x2.contiguous(), packed.a, packed.out_features, packed.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], packed.out_features)


def pack_dpbf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 weight (K even) -> [ceil(N / 32), K / 2, 32, 2] panels of k pairs.

    Panel p, pair j holds W[32p + c, 2j] and W[32p + c, 2j + 1] side by side for c = 0..31 (one
    64-byte load is 16 columns' pair, as VDPBF16PS reads it); columns past N are zero.
    """
    rows = _panel_rows(weight.bfloat16())  # [P, 32, K]
    return rows.unflatten(2, (-1, 2)).transpose(1, 2).contiguous()


class DpBf16Linear(LinearKernel):
    name, cpp_id = "dpbf16", 7

    def available(self, dtype):
        ext = extension.get_extension()
        return dtype == torch.bfloat16 and ext is not None and ext.linear_dpbf16_available()

    def fits(self, weight):
        return weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0

    def pack(self, weight, bias):
        fp32_bias = None if bias is None else bias.float().contiguous()
        return self._packed(weight, pack_dpbf16(weight), None, fp32_bias)

    def apply(self, packed, x):
        ext = extension.load_extension()
        x2 = x.reshape(-1, packed.in_features).to(torch.bfloat16).contiguous()  # [M, K]
        out = ext.linear_dpbf16(x2, packed.a, packed.out_features, packed.bias)  # [M, N]
        return out.reshape(*x.shape[:-1], packed.out_features)


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 (or int8) weight (N % 16 == 0, K % 32 == 0) -> [N / 16, K / 32, 16, 16, 2].

    Tile (n, k) row r, column c holds W[16n + c, 32k + 2r] and W[16n + c, 32k + 2r + 1]: the
    layout TDPBF16PS reads its second operand in; a block's tiles are contiguous along K.
    """
    n, k = weight.shape
    tiles = weight.reshape(n // AMX_TILE_N, AMX_TILE_N, k // AMX_TILE_K, AMX_TILE_K // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous()


def _amx_shape(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return n % AMX_TILE_N == 0 and k % AMX_TILE_K == 0


class AmxLinear(LinearKernel):
    name, cpp_id = "amx", 5

    def available(self, dtype):
        return dtype == torch.bfloat16 and extension.amx_available()

    def fits(self, weight):
        return weight.dtype == torch.bfloat16 and _amx_shape(weight)

    def pack(self, weight, bias):
        fp32_bias = None if bias is None else bias.float().contiguous()
        return self._packed(weight, pack_amx(weight), None, fp32_bias)

    def apply(self, packed, x):
        ext = extension.load_extension()
        x2 = x.reshape(-1, packed.in_features).to(torch.bfloat16).contiguous()  # [M, K]
        out = ext.linear_amx(x2, packed.a, packed.out_features, packed.bias, packed.b)  # [M, N]
        return out.reshape(*x.shape[:-1], packed.out_features)


class MklLinear(LinearKernel):
    # NOTE: PyTorch's _mkl_linear takes the plain weight beside the packed one (its sizes, and
    # F.linear on it where the rows differ from the batch size passed in: apply passes the
    # call's own rows, so the packed sgemm runs at every row count), so the kernel keeps both.
    name, cpp_id, keeps_weight = "mkl", 2, True

    def available(self, dtype):
        return (
            dtype == torch.float32
            and torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_linear")
        )

    def fits(self, weight):
        return weight.dtype == torch.float32

    def pack(self, weight, bias):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_BATCH_HINT)
        return self._packed(weight, packed, weight, bias)

    def apply(self, packed, x):
        x2 = x.reshape(-1, packed.in_features)  # [M, in]
        if x2.shape[0] == 0:
            return F.linear(x, packed.b, packed.bias)
        out = torch.ops.mkl._mkl_linear(x2, packed.a, packed.b, packed.bias, x2.shape[0])
        return out.reshape(*x.shape[:-1], packed.out_features)


class OneDnnLinear(LinearKernel):
    name, cpp_id = "onednn", 3

    def available(self, dtype):
        if not (
            torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        ):
            return False
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return dtype == torch.float32

    def pack(self, weight, bias):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        same_bias = None if bias is None else bias.to(weight.dtype).contiguous()
        return self._packed(weight, packed, None, same_bias)

    def apply(self, packed, x):
        x2 = x.reshape(-1, packed.in_features)  # [M, in]
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], packed.out_features, dtype=packed.a.dtype)
        if x2.dtype != packed.a.dtype:
            x2 = x2.to(packed.a.dtype)
        out = torch.ops.mkldnn._linear_pointwise(
            x2.contiguous(), packed.a, packed.bias, "none", [], ""
        )
        return out.reshape(*x.shape[:-1], packed.out_features)  # [..., out]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (int8 [N, K], scales [N] in the weight's dtype), per output channel."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # [N]
    q = torch.round(w / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


class Int8Linear(LinearKernel):
    name, cpp_id, quantized = "int8", 4, True

    def available(self, dtype):
        return hasattr(torch.ops.aten, "_weight_int8pack_mm")

    def fits(self, weight):
        return weight.dtype in (*FLOAT_DTYPES, torch.float16)

    def pack(self, weight, bias):
        q, scales = quantize_int8(weight)
        same_bias = None if bias is None else bias.to(weight.dtype).contiguous()
        return self._packed(weight, q, scales, same_bias)

    def apply(self, packed, x):
        x2 = x.reshape(-1, packed.in_features).to(packed.b.dtype).contiguous()  # [M, K]
        out = torch.ops.aten._weight_int8pack_mm(x2, packed.a, packed.b)  # [M, N]
        if packed.bias is not None:
            out += packed.bias
        return out.reshape(*x.shape[:-1], packed.out_features)


class Int8AmxLinear(AmxLinear):
    name, cpp_id, quantized = "int8_amx", 6, True

    def pack(self, weight, bias):
        q, scales = quantize_int8(weight)
        fp32_bias = None if bias is None else bias.float().contiguous()
        return self._packed(weight, pack_amx(q), scales.float().contiguous(), fp32_bias)


class QuantizedParts(NamedTuple):
    """A layer's weight as ggml blocks: its pieces (a fused qkv or gate/up projection may store
    each piece in its own type) and the output row each piece starts at."""

    parts: tuple[QuantizedTensor, ...]
    starts: tuple[int, ...]
    out_features: int
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


# Rows from which a GGUF layer dequantises tiles into at::mm instead of the int8 dot kernels
# where the plan measured nothing (the tuner measures it per machine: tuner.tune_quant_rows).
GGUF_PREFILL_ROWS = 128


class GGUFLinear(LinearKernel):
    name, cpp_id, quantized = "gguf", 8, True

    def available(self, dtype):
        ext = extension.get_extension()
        return dtype in FLOAT_DTYPES and ext is not None and hasattr(ext, "QuantLinear")

    def fits(self, weight):
        return isinstance(weight, QuantizedParts)

    def pack(
        self,
        weight: QuantizedParts,
        bias,
        prefill_rows: int = GGUF_PREFILL_ROWS,
        interleave: bool = True,
        amx_rows: int = 0,
    ):
        ext = extension.load_extension()
        index = []
        for part, start in zip(weight.parts, weight.starts, strict=True):
            order = part.row_order
            index.append(None if order is None and start == 0 else _columns(part, start))
        fp32_bias = None if bias is None else bias.float().contiguous()
        compiled = ext.QuantLinear(
            [p.data for p in weight.parts],
            [p.type_id for p in weight.parts],
            index,
            weight.out_features,
            weight.in_features,
            fp32_bias,
            prefill_rows,
            interleave,
            amx_rows,
        )
        # NOTE: ``b`` keeps the parts: those the compiled layer computes on as stored (no copy),
        # and a description of those it repacked, whose blocks as stored are let go.
        layouts = compiled.layouts()
        held = weight._replace(
            parts=tuple(
                part if layout == "rows" else part.released()
                for part, layout in zip(weight.parts, layouts, strict=True)
            )
        )
        return PackedLinear(
            self, weight.out_features, weight.in_features, compiled, held, fp32_bias
        )

    def apply(self, packed, x):
        return packed.a.forward(x if x.dtype in FLOAT_DTYPES else x.float())


def pack_quantized(
    weight: QuantizedParts,
    bias: torch.Tensor | None,
    prefill_rows: int,
    interleave: bool = True,
    amx_rows: int = 0,
) -> PackedLinear:
    """``weight``'s blocks packed for the gguf kernel, which dequantises tiles into at::mm from
    ``prefill_rows`` rows and runs its int8 dot kernels below. Parts of
    8n rows are repacked 8 rows interleaved (their own kernel at every row count) unless
    ``interleave`` is off (the blocks then stay as stored: the row-major dot kernel); from
    ``amx_rows`` rows (0: never) those run on AMX-INT8 tiles where the CPU and build have them."""
    return LINEAR_KERNELS["gguf"].pack(weight, bias, prefill_rows, interleave, amx_rows)


def compiled_linear(ext, packed: PackedLinear):
    """``packed`` as the extension's DecodeLinear (``ext``): the same kernel on the same tensors,
    called from C++ (the decode stack, the fused MoE block)."""
    if packed.name == "gguf":
        # NOTE: the QuantLinear Python packed (bias inside): the C++ side calls that object.
        return ext.DecodeLinear(
            packed.kernel.cpp_id, None, None, None, packed.out_features, quant=packed.a
        )
    return ext.DecodeLinear(
        packed.kernel.cpp_id, packed.a, packed.b, packed.bias, packed.out_features
    )


def _columns(part: QuantizedTensor, start: int) -> torch.Tensor:
    order = part.row_order
    rows = torch.arange(part.shape[0]) if order is None else order.long()
    return (rows + start).to(torch.int32)


LINEAR_KERNELS: dict[str, LinearKernel] = {
    k.name: k
    for k in (
        PanelLinear(),
        DpBf16Linear(),
        AmxLinear(),
        MklLinear(),
        OneDnnLinear(),
        TorchLinear(),
        Int8Linear(),
        Int8AmxLinear(),
        GGUFLinear(),
    )
}
# The candidates for unquantized weights and for int8 weights, in the tuner's order.
KERNELS = ("panels", "dpbf16", "amx", "mkl", "onednn", "torch")
INT8_KERNELS = ("int8", "int8_amx")
# --quantization: int8 (the kernels above), or a GGUF block type (GGUFLinear, quantised at load).
QUANTIZATIONS = ("int8", *QUANTIZE_TYPES)


def get_kernel(name: str) -> LinearKernel:
    """The kernel called ``name``; ValueError naming the choices for an unknown one."""
    if name not in LINEAR_KERNELS:
        raise ValueError(
            f"linear kernel {name!r} is invalid: use one of auto, {', '.join(LINEAR_KERNELS)}"
        )
    return LINEAR_KERNELS[name]


def kernel_available(name: str, dtype: torch.dtype) -> bool:
    """Whether the kernel called ``name`` runs layers in ``dtype`` here."""
    return get_kernel(name).available(dtype)


def candidates(dtype: torch.dtype, names: tuple[str, ...] = KERNELS) -> list[str]:
    """The kernels of ``names`` that run ``dtype`` here, in their order."""
    return [n for n in names if kernel_available(n, dtype)]


def shares_weights(kernel: str, other: str) -> bool:
    """Whether a layer packed for ``other`` already holds what ``kernel`` runs on, so that
    running ``kernel`` beside it costs no second copy of the weights."""
    return kernel == other or (kernel == "torch" and get_kernel(other).keeps_weight)


def fitted_kernel(weight: torch.Tensor | QuantizedParts, name: str) -> str:
    """``name`` if it takes ``weight``, else what runs it in its place: int8 weights that are not
    whole AMX tiles stay int8 (torch's kernel), anything else falls back to F.linear."""
    if isinstance(weight, QuantizedParts):
        return "gguf"
    if weight.device.type == "cpu" and weight.numel() > 0 and get_kernel(name).fits(weight):
        return name
    if name == "int8_amx" and get_kernel("int8").fits(weight):
        return "int8"
    return "torch"


def pack_weight(
    name: str, weight: torch.Tensor | QuantizedParts, bias: torch.Tensor | None = None
) -> PackedLinear:
    """``weight`` (and ``bias``) packed for the kernel called ``name``, or for the kernel that
    runs it in its place where ``name`` does not take it (fitted_kernel)."""
    return get_kernel(fitted_kernel(weight, name)).pack(weight, bias)
