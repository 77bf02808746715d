"""Block codec: keys separate everything that decides compatibility; bad values decode to None."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedattn.kv_transfer.codec import (
    FORMAT_VERSION,
    HEADER_BYTES,
    BlockFormat,
    BlockKeySpace,
    decode_block,
    encode_block,
    split_payload,
)

HASH = bytes(range(16))
SPACE = BlockKeySpace("SmolLM2-135M", "flash", torch.float32, 16)
# A small flash-layout format: 3 layers of [B=4, Hkv=2, D=4] for K and V.
FMT = BlockFormat(torch.float32, 3, (4, 2, 4), (4, 2, 4))


def random_block(fmt: BlockFormat, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    """Random K [L, *key_shape] and V, and the payload bytes they make."""
    payload = torch.empty((fmt.payload_bytes,), dtype=torch.uint8)
    k, v = split_payload(payload, fmt)
    gen = torch.Generator().manual_seed(seed)
    k.copy_(torch.randn(k.shape, generator=gen).to(fmt.dtype))
    v.copy_(torch.randn(v.shape, generator=gen).to(fmt.dtype))
    return k.clone(), v.clone(), payload.numpy().tobytes()


def test_key_names_every_field_and_the_version() -> None:
    key = SPACE.key(HASH)
    assert key == f"pakv{FORMAT_VERSION}:SmolLM2-135M:flash:float32:b16:g0:{HASH.hex()}"
    variants = [
        dataclasses.replace(SPACE, model_id="other"),
        dataclasses.replace(SPACE, layout="classic"),
        dataclasses.replace(SPACE, dtype=torch.bfloat16),
        dataclasses.replace(SPACE, block_size=32),
        dataclasses.replace(SPACE, group_id=1),
    ]
    keys = {space.key(HASH) for space in variants} | {key, SPACE.key(bytes(16))}
    assert len(keys) == len(variants) + 2


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model_id", "", "model_id"),
        ("block_size", 0, "block_size"),
        ("group_id", -1, "group_id"),
        ("dtype", torch.int8, "not supported"),
    ],
)
def test_key_space_rejects_bad_fields(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPACE, **{field: value})


def test_format_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="key_shape"):
        BlockFormat(torch.float32, 1, (1, 2, 3, 4, 5), (4,))
    with pytest.raises(ValueError, match="value_shape"):
        BlockFormat(torch.float32, 1, (4,), (0, 4))
    with pytest.raises(ValueError, match="num_layers"):
        BlockFormat(torch.float32, 0, (4,), (4,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bitwise(dtype: torch.dtype) -> None:
    # Classic-layout shapes: K [Hkv, D/x, B, x], V [Hkv, D, B].
    fmt = BlockFormat(dtype, 2, (2, 2, 4, 4), (2, 8, 4))
    k, v, payload = random_block(fmt)
    key = SPACE.key(HASH)
    value = encode_block(fmt, key, payload)
    assert len(value) == fmt.value_bytes
    decoded = decode_block(value, fmt, key)
    assert decoded is not None and bytes(decoded) == payload
    k2, v2 = split_payload(torch.frombuffer(bytearray(decoded), dtype=torch.uint8), fmt)
    assert k2.dtype == dtype and k2.shape == (2, 2, 2, 4, 4) and v2.shape == (2, 2, 8, 4)
    assert torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8))


def test_encode_rejects_a_payload_of_the_wrong_size() -> None:
    with pytest.raises(ValueError, match="payload has"):
        encode_block(FMT, SPACE.key(HASH), b"\0" * (FMT.payload_bytes - 1))


def _corruptions(value: bytes) -> dict[str, bytes | None]:
    def flip(data: bytes, i: int) -> bytes:
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]

    return {
        "missing": None,
        "empty": b"",
        "truncated by one byte": value[:-1],
        "header only": value[:HEADER_BYTES],
        "one byte appended": value + b"\0",
        "bad magic": b"XXXX" + value[4:],
        "other version": value[:4] + bytes([value[4] + 1]) + value[5:],
        "flipped payload byte": flip(value, HEADER_BYTES + 7),
        "flipped last payload byte": flip(value, len(value) - 17),
        "flipped checksum byte": flip(value, len(value) - 1),
    }


@pytest.mark.parametrize("kind", list(_corruptions(b"\0" * 100)))
def test_every_corruption_kind_decodes_to_none(kind: str) -> None:
    key = SPACE.key(HASH)
    value = encode_block(FMT, key, random_block(FMT)[2])
    assert decode_block(_corruptions(value)[kind], FMT, key) is None


def test_any_single_flipped_byte_decodes_to_none() -> None:
    fmt = BlockFormat(torch.float32, 1, (2, 1, 2), (2, 1, 2))
    key = SPACE.key(HASH)
    value = encode_block(fmt, key, random_block(fmt)[2])
    for i in range(len(value)):
        for bit in (0x01, 0x80):
            bad = value[:i] + bytes([value[i] ^ bit]) + value[i + 1 :]
            assert decode_block(bad, fmt, key) is None, f"byte {i} bit {bit:#x}"


def test_mismatched_expectations_decode_to_none() -> None:
    key = SPACE.key(HASH)
    value = encode_block(FMT, key, random_block(FMT)[2])
    same_bytes_other_shape = BlockFormat(torch.float32, 3, (2, 4, 4), (4, 2, 4))
    assert same_bytes_other_shape.payload_bytes == FMT.payload_bytes
    for fmt in (
        same_bytes_other_shape,
        BlockFormat(torch.float32, 2, (4, 2, 4), (4, 2, 4)),
        BlockFormat(torch.bfloat16, 3, (4, 2, 8), (4, 2, 8)),  # same byte count, other dtype
    ):
        assert decode_block(value, fmt, key) is None
    # The right format under another key (another tenant's hash, another model) fails too.
    assert decode_block(value, FMT, SPACE.key(bytes(16))) is None
    assert decode_block(value, FMT, dataclasses.replace(SPACE, model_id="x").key(HASH)) is None
    assert decode_block(value, FMT, key) is not None


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=FMT.value_bytes + 8))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    assert decode_block(data, FMT, SPACE.key(HASH)) is None


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0), st.binary(min_size=1, max_size=4))
def test_bytes_spliced_into_a_good_value_never_decode(pos: int, junk: bytes) -> None:
    key = SPACE.key(HASH)
    value = encode_block(FMT, key, random_block(FMT)[2])
    pos %= len(value)
    bad = value[:pos] + junk + value[pos + len(junk) :]
    if bad != value:
        assert decode_block(bad, FMT, key) is None


def test_payload_in_parts_encodes_like_one_buffer() -> None:
    payload = random_block(FMT)[2]
    key = SPACE.key(HASH)
    cuts = [0, 5, 96, 97, len(payload)]
    parts = [memoryview(payload)[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert encode_block(FMT, key, *parts) == encode_block(FMT, key, payload)
    with pytest.raises(ValueError, match="payload has"):
        encode_block(FMT, key, *parts[:-1])
