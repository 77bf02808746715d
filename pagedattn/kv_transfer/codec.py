"""Store keys and values of KV cache blocks: a versioned key, a header + payload + checksum value.

A value holds one block's K and V for every layer of its KV cache group:

    header (magic, format version, dtype, num_layers, one layer's K and V block shapes, payload
    length) | payload (K of layer 0..L-1, then V of layer 0..L-1, raw bytes) | checksum

The checksum is BLAKE2b-128 over the key, the header and the payload, so a value that sits under
another key (a tenant's, or another model's) fails the check exactly like flipped bytes do.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from hashlib import blake2b

import torch

# Bumped whenever the key or the value format changes: old entries then simply miss.
FORMAT_VERSION = 2
MAGIC = b"PAKV"
CHECKSUM_BYTES = 16
# Block shapes have at most 4 dims (classic key: [num_kv_heads, head_size / x, B, x]).
MAX_BLOCK_DIMS = 4
# magic, version, dtype code, num_layers, key ndim, value ndim, key dims, value dims, payload len,
# zero padding to 64 bytes.
# NOTE: the padding aligns the payload, so a value read into a buffer is viewed as K/V in place.
_HEADER = struct.Struct(f"<4sHBHBB{MAX_BLOCK_DIMS}I{MAX_BLOCK_DIMS}IQ13x")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 64

_DTYPE_CODES = {
    torch.float32: 1,
    torch.bfloat16: 2,
    torch.float16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
    torch.uint8: 6,  # the u8 cache: each row's scale and min travel inside the block
}
# NOTE: fp8 blocks hold K / k_scale and V / v_scale: a reader must use the writer's scales
# (the defaults, 1.0, or scales computed from the same first prefill).
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.uint8: "u8",
}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's short name as used in keys ('float32'); raises for an unsupported dtype."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        allowed = ", ".join(_DTYPE_NAMES.values())
        raise ValueError(f"KV store dtype {dtype} is not supported: use one of {allowed}") from None


@dataclass(frozen=True)
class BlockKeySpace:
    """Everything besides the block hash that decides whether a stored block fits this cache."""

    model_id: str
    layout: str
    dtype: torch.dtype
    block_size: int
    group_id: int = 0

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id is empty: give the model's name or path")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} is invalid: use a positive integer")
        if not isinstance(self.group_id, int) or self.group_id < 0:
            raise ValueError(f"group_id={self.group_id!r} is invalid: use an integer >= 0")
        dtype_name(self.dtype)
        prefix = (
            f"pakv{FORMAT_VERSION}:{self.model_id}:{self.layout}:{dtype_name(self.dtype)}"
            f":b{self.block_size}:g{self.group_id}:"
        )
        object.__setattr__(self, "_prefix", prefix)

    def key(self, block_hash: bytes) -> str:
        """The store key of one block: the space's fields and the block's chained hash in hex."""
        if not block_hash:
            raise ValueError("block_hash is empty")
        return self._prefix + block_hash.hex()


@dataclass(frozen=True)
class BlockFormat:
    """What a decoded value must match: dtype, layer count and one layer's K and V block shape."""

    dtype: torch.dtype
    num_layers: int
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        object.__setattr__(self, "key_shape", tuple(int(d) for d in self.key_shape))
        object.__setattr__(self, "value_shape", tuple(int(d) for d in self.value_shape))
        for name, shape in (("key_shape", self.key_shape), ("value_shape", self.value_shape)):
            if not 1 <= len(shape) <= MAX_BLOCK_DIMS or min(shape) < 1:
                raise ValueError(
                    f"{name}={shape} is invalid: use 1 to {MAX_BLOCK_DIMS} positive dims"
                )
        if self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} is invalid: use at least 1")
        object.__setattr__(self, "_header", self._pack_header())

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def key_bytes(self) -> int:
        """Bytes of the K part of the payload (all layers)."""
        return self.num_layers * math.prod(self.key_shape) * self.element_size

    @property
    def payload_bytes(self) -> int:
        value_bytes = self.num_layers * math.prod(self.value_shape) * self.element_size
        return self.key_bytes + value_bytes

    @property
    def value_bytes(self) -> int:
        """Bytes of a whole encoded value: header, payload, checksum."""
        return HEADER_BYTES + self.payload_bytes + CHECKSUM_BYTES

    def header(self) -> bytes:
        """The value header every block of this format carries."""
        return self._header

    def _pack_header(self) -> bytes:
        pad = (0,) * MAX_BLOCK_DIMS
        key_dims = (self.key_shape + pad)[:MAX_BLOCK_DIMS]
        value_dims = (self.value_shape + pad)[:MAX_BLOCK_DIMS]
        return _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            _DTYPE_CODES[self.dtype],
            self.num_layers,
            len(self.key_shape),
            len(self.value_shape),
            *key_dims,
            *value_dims,
            self.payload_bytes,
        )


def _checksum(key: str, header: bytes | memoryview, *payload_parts: memoryview) -> bytes:
    digest = blake2b(key.encode(), digest_size=CHECKSUM_BYTES)
    digest.update(header)
    for part in payload_parts:
        digest.update(part)
    return digest.digest()


def split_payload(payload: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (k, v) of uint8 payloads [..., payload_bytes] as [..., num_layers, *block_shape]."""
    if payload.dtype != torch.uint8 or payload.shape[-1] != fmt.payload_bytes:
        raise ValueError(
            f"payload must be uint8 [..., {fmt.payload_bytes}], got {payload.dtype} "
            f"{tuple(payload.shape)}"
        )
    lead = tuple(payload.shape[:-1])
    k = payload[..., : fmt.key_bytes].view(fmt.dtype)  # [..., L * prod(key_shape)]
    v = payload[..., fmt.key_bytes :].view(fmt.dtype)  # [..., L * prod(value_shape)]
    return (
        k.view(*lead, fmt.num_layers, *fmt.key_shape),
        v.view(*lead, fmt.num_layers, *fmt.value_shape),
    )


def encode_block(fmt: BlockFormat, key: str, *payload_parts: bytes | memoryview) -> bytes:
    """One block's stored value: header | payload | checksum.

    The payload is the concatenation of payload_parts (one buffer, or, say, each layer's K and
    then each layer's V), in the order split_payload reads it.
    """
    parts = [memoryview(part).cast("B") for part in payload_parts]
    num_bytes = sum(part.nbytes for part in parts)
    if num_bytes != fmt.payload_bytes:
        raise ValueError(f"payload has {num_bytes} bytes, the format needs {fmt.payload_bytes}")
    header = fmt.header()
    return b"".join((header, *parts, _checksum(key, header, *parts)))


def decode_block(
    value: bytes | bytearray | memoryview | None, fmt: BlockFormat, key: str
) -> memoryview | None:
    """The verified payload bytes of a stored value, or None if anything about it is wrong.

    value may be any buffer (a numpy row the value was read into, say); the payload returned is a
    view of it, at offset HEADER_BYTES.

    Never raises on bad bytes: None for a missing value, a wrong length, bad magic or version,
    another dtype, layer count or block shape than fmt, or a checksum mismatch (flipped bytes,
    or a value stored under another key).
    """
    if value is None:
        return None
    view = memoryview(value).cast("B")
    if view.nbytes != fmt.value_bytes:
        return None
    header = view[:HEADER_BYTES]
    if header != fmt.header():
        return None
    payload_end = HEADER_BYTES + fmt.payload_bytes
    payload = view[HEADER_BYTES:payload_end]
    if _checksum(key, header, payload) != view[payload_end:]:
        return None
    return payload
