"""gguf_retype.py: the shipped Q4_1 SmolLM2 rewritten with the same numbers in BF16."""

import gguf
import numpy as np
import pytest

from pagedattn.benchmarks.gguf_retype import gguf_type_name, retyped_gguf
from pagedattn.model.loader import packaged_model_path


def test_type_names():
    assert gguf_type_name("float32") == "F32"
    assert gguf_type_name("bfloat16") == gguf_type_name("bf16") == "BF16"
    assert gguf_type_name("f16") == "F16"
    with pytest.raises(ValueError, match="no GGUF type for 'q4_0'"):
        gguf_type_name("q4_0")


def test_retyped_file_holds_the_same_numbers_in_bf16(tmp_path):
    src = packaged_model_path("smollm2-135m")
    dest = retyped_gguf(src, "bfloat16", tmp_path)
    assert dest == tmp_path / f"{src.stem}.BF16.gguf"
    old, new = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dest))
    # Metadata carried over (tokenizer included), file type updated.
    for key in ("llama.block_count", "tokenizer.ggml.model", "tokenizer.chat_template"):
        assert new.fields[key].contents() == old.fields[key].contents()
    assert len(new.fields["tokenizer.ggml.tokens"].contents()) == 49152
    assert new.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_BF16)
    old_tensors = {t.name: t for t in old.tensors}
    assert sorted(old_tensors) == sorted(t.name for t in new.tensors)
    for t in new.tensors:
        before = gguf.quants.dequantize(old_tensors[t.name].data, old_tensors[t.name].tensor_type)
        after = gguf.quants.dequantize(t.data, t.tensor_type)
        assert after.shape == before.shape
        if before.ndim == 1:  # norm weights stay float32, bit for bit
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(after, before)
        else:  # the dequantised weights, rounded to bf16 (relative error <= 2^-8)
            assert t.tensor_type == gguf.GGMLQuantizationType.BF16
            np.testing.assert_allclose(after, before, rtol=2**-8, atol=0)
    # Written once: the next call reuses the file.
    stamp = dest.stat().st_mtime_ns
    assert retyped_gguf(src, "bf16", tmp_path) == dest
    assert dest.stat().st_mtime_ns == stamp
