"""GGUFFile reads the same fields and tensor bytes as gguf's own reader, long arrays as lengths."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from pagedattn.model.gguf_file import MAX_ARRAY, ArrayInfo, GGUFFile, GGUFFileError


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "t.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 3)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_bool("flag", True)
    writer.add_array("short", [1, 2, 3])
    writer.add_array("tokens", [f"tok{i}" for i in range(MAX_ARRAY + 5)])
    writer.add_array("scores", [float(i) for i in range(MAX_ARRAY + 1)])
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((6, 64)).astype(np.float32)
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("a.weight", f32)
    writer.add_tensor(
        "b.weight",
        quantize(q8, GGMLQuantizationType.Q8_0),
        raw_dtype=GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_fields_and_tensors_match_ggufs_reader(gguf_path):
    ours, theirs = GGUFFile(gguf_path), GGUFReader(gguf_path)
    assert ours.fields["llama.block_count"] == 3
    assert ours.fields["general.name"] == "tiny ünïcode"
    assert ours.fields["flag"] is True and ours.fields["short"] == [1, 2, 3]
    assert ours.fields["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert (
        ours.fields["tokens"] == ArrayInfo(8, MAX_ARRAY + 5) and len(ours.fields["tokens"]) == 1029
    )
    assert len(ours.fields["scores"]) == MAX_ARRAY + 1
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in reversed(ref.shape))
        assert mine.tensor_type == ref.tensor_type
        got = ours.tensor_bytes(mine)
        assert got.dtype == np.uint8 and got.shape[0] == mine.shape[0]
        assert np.array_equal(got.reshape(-1), ref.data.reshape(-1).view(np.uint8))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(GGUFFileError, match="is not a GGUF file"):
        GGUFFile(path)
