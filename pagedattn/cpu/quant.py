"""Weights in GGUF (ggml) block formats, kept as stored: the types, a tensor of blocks, quantisers.

A ``QuantizedTensor`` is one [rows, cols] weight as uint8 [rows, bytes per row] of ggml blocks
(a view of the GGUF file's memory map where the layout allows, so nothing is copied); the
compiled kernels (csrc/quant_cpu.cpp, through ``GGUFLinear`` in pagedattn.cpu.linear) compute
on the blocks. ``quantize`` turns a float weight into blocks (``--quantization q8_0|q4_0|...``
for HF checkpoints): Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 by gguf's own quantisers (llama.cpp's
reference rounding), Q4_K here (per sub-block scale and minimum from the range, no search).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

# ggml type name -> (type id, values per block, bytes per block): the types with kernels.
GGUF_TYPES: dict[str, tuple[int, int, int]] = {
    "q4_0": (2, 32, 18),
    "q4_1": (3, 32, 20),
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
    "q8_0": (8, 32, 34),
    "iq4_nl": (20, 32, 18),
    "q2_k": (10, 256, 84),
    "q3_k": (11, 256, 110),
    "q4_k": (12, 256, 144),
    "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210),
    "iq4_xs": (23, 256, 136),
}
TYPE_NAMES = {type_id: name for name, (type_id, _, _) in GGUF_TYPES.items()}
BLOCK_VALUES = {type_id: block for type_id, block, _ in GGUF_TYPES.values()}
BLOCK_BYTES = {type_id: size for type_id, _, size in GGUF_TYPES.values()}
# What --quantization takes: the types quantize() writes.
QUANTIZE_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k")


def type_name(type_id: int) -> str:
    """``Q4_K`` for 12: gguf's name of a ggml type (any type, not only those with kernels)."""
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(type_id).name


def has_kernel(type_id: int, cols: int) -> bool:
    """Whether a [rows, cols] tensor of ggml type ``type_id`` runs as stored (a type with kernels
    and whole blocks per row)."""
    return type_id in BLOCK_VALUES and cols % BLOCK_VALUES[type_id] == 0


@dataclass(frozen=True)
class QuantizedTensor:
    """A [rows, cols] weight in ggml blocks.

    ``data``: uint8 [rows, cols / block values * block bytes]. ``row_order``: stored row r is
    row row_order[r] of the weight (llama.cpp stores Q/K rows permuted for its rope; the kernel
    writes each row's output where it belongs instead of copying the blocks); None: in order.
    """

    type_id: int
    data: torch.Tensor
    cols: int
    row_order: torch.Tensor | None = None
    # Drops a file-backed tensor's pages from resident memory (gguf_loader sets it): called
    # by ``released`` once a compiled layer has repacked the blocks, so that peak memory is
    # not the file's pages and their repacked copies at once.
    release: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.type_id not in BLOCK_VALUES:
            raise ValueError(f"ggml type {type_name(self.type_id)} has no kernel")
        want = self.cols // BLOCK_VALUES[self.type_id] * BLOCK_BYTES[self.type_id]
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != want:
            raise ValueError(
                f"{self.name} blocks of a {self.cols}-column weight are uint8 [rows, {want}], "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def name(self) -> str:
        return TYPE_NAMES[self.type_id].upper()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def narrow(self, dim: int, start: int, count: int) -> QuantizedTensor:
        """The weight's rows (dim 0) or columns (dim 1) [start, start + count), as blocks.

        Rows: a view of the blocks where the stored rows of that range are contiguous (a range
        of whole heads of llama.cpp's permuted Q/K rows is), else a copy; ``row_order`` follows.
        Columns: a copy of whole blocks; ValueError when the range splits a block.
        """
        if dim == 1:
            block, size = BLOCK_VALUES[self.type_id], BLOCK_BYTES[self.type_id]
            if start % block or count % block:
                raise ValueError(
                    f"{self.name} blocks hold {block} columns each; columns {start}.."
                    f"{start + count - 1} do not start and end on a block"
                )
            lo, hi = start // block * size, (start + count) // block * size
            data = self.data[:, lo:hi].contiguous()
            return dataclasses.replace(self, data=data, cols=count)
        if self.row_order is None:
            return dataclasses.replace(self, data=self.data.narrow(0, start, count))
        order = self.row_order.long()
        stored = torch.nonzero((order >= start) & (order < start + count)).flatten()
        first = int(stored[0])
        if torch.equal(stored, torch.arange(first, first + count)):
            data = self.data.narrow(0, first, count)
        else:
            data = self.data[stored]
        local = (order[stored] - start).to(torch.int32)
        return dataclasses.replace(self, data=data, row_order=local)

    def padded(self, rows: int) -> QuantizedTensor:
        """A copy with zero blocks appended up to ``rows`` rows (they dequantise to zeros: every
        type's scales are then 0); rows must be in order."""
        data = self.data.new_zeros(rows, self.data.shape[1])
        data[: self.data.shape[0]] = self.data
        return dataclasses.replace(self, data=data)

    def released(self) -> QuantizedTensor:
        """This tensor's description without its blocks (a meta tensor of the same shape): what
        is kept once a compiled layer has repacked them, so they are held once. Its name, shape
        and bytes still answer; dequantise through the layer (QuantLinear.rows)."""
        if self.release is not None:
            self.release()
        meta = torch.empty(self.data.shape, dtype=torch.uint8, device="meta")
        return dataclasses.replace(self, data=meta, release=None)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], rows in the weight's order."""
        from pagedattn.cpu import extension

        ext = extension.get_extension()
        if ext is not None and hasattr(ext, "quant_dequantize"):
            w = ext.quant_dequantize(self.data.contiguous(), self.type_id, self.cols)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            raw = dequantize(self.data.numpy(), GGMLQuantizationType(self.type_id))
            w = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.float32))
        if self.row_order is None:
            return w
        out = torch.empty_like(w)
        out[self.row_order.long()] = w
        return out


def quantize(weight: torch.Tensor, kind: str) -> QuantizedTensor:
    """``weight`` [rows, cols] in blocks of type ``kind`` (one of QUANTIZE_TYPES); cols must be a
    whole number of blocks."""
    type_id, block, _ = GGUF_TYPES[kind]
    rows, cols = weight.shape
    if cols % block:
        raise ValueError(f"{kind} needs columns in blocks of {block}; the weight has {cols}")
    w = weight.detach().float().contiguous()
    if kind == "q4_k":
        data = _quantize_q4_k(w)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gguf_quantize

        raw = gguf_quantize(w.numpy(), GGMLQuantizationType[kind.upper()])
        data = torch.from_numpy(np.ascontiguousarray(raw).reshape(rows, -1))
    return QuantizedTensor(type_id, data, cols)


def _quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols] -> Q4_K blocks uint8 [rows, cols / 256 * 144].

    Each 32-value sub-block gets x ~ scale * q - min with q in 0..15 from its own range; the 8
    scales and mins of a block are 6-bit multiples of the block's fp16 d and dmin (llama.cpp's
    layout; its quantiser also searches the range, this one takes min and max as they are).
    """
    rows, cols = w.shape
    nb = cols // 256
    x = w.reshape(rows, nb, 8, 32)
    lo = x.amin(-1).clamp(max=0.0)  # [rows, nb, 8]
    hi = x.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=0.0)
    mins = -lo
    d = (scale.amax(-1) / 63.0).half().float()  # [rows, nb]
    dmin = (mins.amax(-1) / 63.0).half().float()
    inv_d = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    inv_dmin = torch.where(dmin > 0, 1.0 / dmin, torch.zeros_like(dmin))
    sc = torch.round(scale * inv_d[..., None]).clamp(0, 63).to(torch.uint8)  # [rows, nb, 8]
    mn = torch.round(mins * inv_dmin[..., None]).clamp(0, 63).to(torch.uint8)
    eff_scale = d[..., None] * sc.float()  # [rows, nb, 8]
    eff_min = dmin[..., None] * mn.float()
    inv = torch.where(eff_scale > 0, 1.0 / eff_scale, torch.zeros_like(eff_scale))
    q = torch.round((x + eff_min[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    # qs: per 64 values, byte l = value l (low nibble) | value 32 + l (high nibble)
    q = q.reshape(rows, nb, 4, 2, 32)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, nb, 128)
    scales = torch.empty(rows, nb, 12, dtype=torch.uint8)
    scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    head = torch.stack((d.half(), dmin.half()), dim=-1).view(torch.uint8)  # [rows, nb, 4]
    return torch.cat((head, scales, qs), dim=-1).reshape(rows, nb * 144).contiguous()
