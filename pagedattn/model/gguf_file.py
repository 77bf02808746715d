"""A GGUF file's metadata and tensor table, read in milliseconds (gguf's reader takes seconds).

``gguf.GGUFReader`` builds a numpy view for every part of every field, so a 49k-entry vocabulary
costs SmolLM2 ~7 s. Loading needs the scalar fields, a few short arrays and the tensor table;
this reader walks the file once with ``struct`` and keeps arrays longer than ``MAX_ARRAY`` as
their length only (the tokenizer is converted by transformers, once, and cached).

Layout (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 field
count; fields (string key, u32 value type, value); tensor infos (string name, u32 n_dims,
u64 dims[n_dims] innermost first, u32 ggml type, u64 offset); tensor data at the next multiple
of ``general.alignment`` (32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ARRAY = 1024  # longer arrays are kept as ArrayInfo (their element type and length)

# GGUF value type -> struct format of a scalar (8: string, 9: array are handled apart).
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFFileError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class ArrayInfo:
    """A long array field, not read: its GGUF element type and length."""

    value_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: name, shape (outermost first, as numpy), type, absolute offset."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int  # a gguf.GGMLQuantizationType value
    offset: int

    @property
    def num_bytes(self) -> int:
        # NOTE: imported here: the gguf package costs ~80 ms to import (it loads yaml), and a
        # start whose weights are cached reads no tensor.
        from gguf import GGML_QUANT_SIZES

        block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
        num_elements = int(np.prod(self.shape))
        return num_elements // block_size * type_size


class GGUFFile:
    """The fields and tensor table of a GGUF file; tensor bytes are read from a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != GGUF_MAGIC:
            raise GGUFFileError(f"{self.path} is not a GGUF file (magic {self._map[:4]!r})")
        self.version, num_tensors, num_fields = struct.unpack_from("<IQQ", self._map, 4)
        if self.version < 2:
            raise GGUFFileError(f"{self.path} is GGUF v{self.version}; v2 or later is needed")
        self._pos = 4 + struct.calcsize("<IQQ")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.fields[key] = self._value(value_type)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            tensor_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), tensor_type, offset))
        alignment = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]

    def release_pages(self) -> None:
        """Drop the map's pages from this process's resident memory: they stay in the page
        cache, and a tensor read again faults back in. Called once the model has packed what
        it runs (repacked blocks are copies; the rows as stored are no longer read)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = self._map[self._pos : self._pos + length].decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type])[0]
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise GGUFFileError(f"{self.path}: unknown GGUF value type {value_type}")
        item_type, length = self._unpack("<IQ")
        if item_type in _SCALARS and length > MAX_ARRAY:
            self._pos += struct.calcsize(_SCALARS[item_type]) * length  # NOTE: skipped unread
            return ArrayInfo(item_type, length)
        if item_type == _STRING and length > MAX_ARRAY:
            for _ in range(length):
                (size,) = struct.unpack_from("<Q", self._map, self._pos)
                self._pos += 8 + size
            return ArrayInfo(item_type, length)
        return [self._value(item_type) for _ in range(length)]

    def tensor_bytes(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's raw data as uint8 [*outer dims, bytes per innermost row] (no copy)."""
        flat = np.frombuffer(
            self._map, dtype=np.uint8, count=tensor.num_bytes, offset=tensor.offset
        )
        return flat.reshape(*tensor.shape[:-1], -1)
