"""synthetic.py: a tiny model through the same code path as `--synthetic llama-1b`.

The HF folder and the F16 GGUF must be the same model: the GGUF holds the folder's numbers
exactly (Q/K rows in llama.cpp's order), pagedattn gives both the same logits and greedy tokens,
and llama.cpp reads the GGUF as the same model too (its NLL close to pagedattn's on the folder).
"""

from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from pagedattn.benchmarks.bench_nll import pagedattn_nll
from pagedattn.benchmarks.bench_quant import SequenceRunner
from pagedattn.benchmarks.synthetic import (
    SyntheticShape,
    permute_qk,
    synthetic_checkpoint,
    tensor_specs,
)
from pagedattn.model.gguf_loader import unpermute_qk
from pagedattn.model.loader import load_model

# Weights large enough that attention is far from uniform: a Q/K row-order slip shows.
TINY = SyntheticShape(64, 2, 4, 2, 128, weight_std=0.25)
PROMPT = [1, 504, 2714, 314, 4443, 7000, 314, 11, 2560, 281, 34, 1993, 9, 700, 451, 88]
HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
NEEDS_LLAMA_CPP = "llama-cpp-python is not installed (`make bench-peers` installs it)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    kinds = ("hf", "f16", "q8_0", "q4_0") if HAS_LLAMA_CPP else ("hf", "f16")
    root = tmp_path_factory.mktemp("synthetic")
    return synthetic_checkpoint("tiny", kinds, shape=TINY, cache_dir=root)


def test_permute_qk_is_undone_by_the_loader():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads of 4 rows
    permuted = permute_qk(w, 2)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, 2), w)


def test_f16_gguf_holds_the_hf_folders_numbers(tiny):
    index = json.loads((tiny.hf_dir / "model.safetensors.index.json").read_text())
    config = json.loads((tiny.hf_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["vocab_size"] == 49152
    assert (tiny.hf_dir / "tokenizer.json").exists()
    reader = gguf.GGUFReader(str(tiny.gguf("f16")))
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    tensors = {t.name: t for t in reader.tensors}
    specs = tensor_specs(TINY, 49152)
    assert sorted(tensors) == sorted(g for _, g, _ in specs) and "output.weight" not in tensors
    for hf_name, gguf_name, shape in specs:
        with safe_open(str(tiny.hf_dir / index["weight_map"][hf_name]), framework="pt") as f:
            ours = f.get_tensor(hf_name)
        assert ours.dtype == torch.bfloat16 and tuple(ours.shape) == shape
        theirs = np.asarray(tensors[gguf_name].data, dtype=np.float32).reshape(shape)
        if "attn_q" in gguf_name or "attn_k" in gguf_name:
            theirs = unpermute_qk(theirs, TINY.num_heads if "attn_q" in gguf_name else 2)
        np.testing.assert_array_equal(theirs, ours.float().numpy())  # exactly, not rounded


def _folder_and_gguf(ckpt) -> tuple[list[torch.Tensor], list[list[int]]]:
    """pagedattn's prompt logits and 12 greedy tokens from the HF folder, then the F16 GGUF."""
    logits, greedy = [], []
    for path in (ckpt.hf_dir, ckpt.gguf("f16")):
        runner = SequenceRunner(load_model(str(path), "float32", "cpu").model, 64)
        logits.append(runner.forward(PROMPT, 0))
        greedy.append(runner.greedy(PROMPT, 12)[0])
    return logits, greedy


def test_pagedattn_runs_the_folder_and_the_gguf_as_one_model(tiny):
    logits, greedy = _folder_and_gguf(tiny)
    assert torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert greedy[0] == greedy[1]
    assert len(set(greedy[0])) > 1  # attention matters: not one token repeated


def test_cached_files_are_reused(tiny):
    stamps = {k: tiny.path(k).stat().st_mtime_ns for k in ("hf", "f16")}
    again = synthetic_checkpoint("tiny", ("hf", "f16"), shape=TINY, cache_dir=tiny.root.parent)
    assert again == tiny
    assert {k: again.path(k).stat().st_mtime_ns for k in ("hf", "f16")} == stamps


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NEEDS_LLAMA_CPP)
def test_llama_cpp_reads_the_gguf_as_the_same_model_and_q8_0_loads(tiny):
    from pagedattn.benchmarks.llama_cpp_peer import run_isolated

    tokens = PROMPT * 4
    job = {"gguf": str(tiny.gguf("f16")), "tokens": tokens, "threads": 2}
    theirs = run_isolated("nll", job)["nll"]
    ours = pagedattn_nll(load_model(str(tiny.hf_dir), "float32", "cpu").model, tokens)
    assert np.isfinite(theirs) and abs(theirs - ours) < 0.01 * ours
    # The quantised file: llama.cpp's own Q8_0, which pagedattn loads and runs.
    reader = gguf.GGUFReader(str(tiny.gguf("q8_0")))
    types = {t.tensor_type for t in reader.tensors if t.name.endswith("attn_q.weight")}
    assert types == {gguf.GGMLQuantizationType.Q8_0}
    quant = load_model(str(tiny.gguf("q8_0")), "float32", "cpu").model
    q_logits = SequenceRunner(quant, 64).forward(PROMPT, 0)
    assert torch.isfinite(q_logits).all()
    assert abs(pagedattn_nll(quant, tokens) - ours) < 0.05 * ours


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NEEDS_LLAMA_CPP)
def test_the_q4_0_file_runs_interleaved_as_llama_cpp_runs_it(tiny):
    """llama.cpp's own Q4_0 file: its projections stay Q4_0 blocks (interleaved 8 rows, the
    legacy x8 kernel) and pagedattn's NLL on it is llama.cpp's on the same file."""
    from pagedattn.benchmarks.llama_cpp_peer import run_isolated

    reader = gguf.GGUFReader(str(tiny.gguf("q4_0")))
    types = {t.tensor_type for t in reader.tensors if t.name.endswith("ffn_up.weight")}
    assert types == {gguf.GGMLQuantizationType.Q4_0}
    model = load_model(str(tiny.gguf("q4_0")), "float32", "cpu").model
    packed = [getattr(m, "decode", None) for m in model.modules()]
    layouts = {lay for p in packed if getattr(p, "name", None) == "gguf" for lay in p.a.layouts()}
    assert layouts == {"x8"}
    tokens = PROMPT * 4
    theirs = run_isolated("nll", {"gguf": str(tiny.gguf("q4_0")), "tokens": tokens, "threads": 2})
    # 12.795 against 12.801 (the bf16 folder: 12.937, 1.1% away)
    assert abs(pagedattn_nll(model, tokens) - theirs["nll"]) < 0.002 * theirs["nll"]


# K-type blocks need rows of whole 256-value superblocks: a tiny shape 256 wide.
TINY_K = SyntheticShape(256, 2, 4, 2, 512, weight_std=0.125)


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NEEDS_LLAMA_CPP)
@pytest.mark.parametrize(
    "kind, ggml_type, shape",
    [
        ("q3_k_m", "Q3_K", TINY_K),
        ("q2_k", "Q2_K", TINY_K),
        ("iq4_xs", "IQ4_XS", TINY_K),
        ("iq4_nl", "IQ4_NL", TINY_K),
        # 64 wide: no whole 256-value superblocks, llama.cpp writes IQ4_NL instead of IQ4_XS
        ("iq4_xs", "IQ4_NL", TINY),
    ],
)
def test_the_2_and_3_bit_and_iq4_files_run_as_llama_cpp_runs_them(tmp_path, kind, ggml_type, shape):
    """llama.cpp's own Q3_K_M, Q2_K, IQ4_XS and IQ4_NL files: their Q3_K / Q2_K / IQ4_XS /
    IQ4_NL tensors stay in blocks (interleaved 8 rows, csrc/quant_x8_low_cpu.h,
    quant_x8_iq_cpu.h, quant_x8_legacy_cpu.h) and pagedattn's NLL on the file is llama.cpp's."""
    from pagedattn.benchmarks.llama_cpp_peer import run_isolated

    name = "tiny-k" if shape is TINY_K else "tiny"
    files = synthetic_checkpoint(name, ("hf", "f16", kind), shape=shape, cache_dir=tmp_path)
    reader = gguf.GGUFReader(str(files.gguf(kind)))
    types = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.")}
    assert ggml_type in types
    model = load_model(str(files.gguf(kind)), "float32", "cpu").model
    packed = [getattr(m, "decode", None) for m in model.modules()]
    gguf_layers = [p for p in packed if getattr(p, "name", None) == "gguf"]
    assert gguf_layers and {lay for p in gguf_layers for lay in p.a.layouts()} == {"x8"}
    tokens = PROMPT * 4
    theirs = run_isolated("nll", {"gguf": str(files.gguf(kind)), "tokens": tokens, "threads": 2})
    ours = pagedattn_nll(model, tokens)
    assert abs(ours - theirs["nll"]) < 0.002 * theirs["nll"], (ours, theirs["nll"])


# A tiny Qwen3-MoE shape: 4 experts, top-2 (the qwen3-moe-scaled code path: qwen3moe GGUF).
TINY_MOE = SyntheticShape(
    64,
    2,
    4,
    2,
    128,
    weight_std=0.25,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    kinds = ("hf", "f16", "q8_0") if HAS_LLAMA_CPP else ("hf", "f16")
    root = tmp_path_factory.mktemp("synthetic-moe")
    return synthetic_checkpoint("tiny-moe", kinds, shape=TINY_MOE, cache_dir=root)


def test_moe_gguf_stacks_the_experts_and_runs_as_the_folder(tiny_moe):
    reader = gguf.GGUFReader(str(tiny_moe.gguf("f16")))
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.expert_count"].contents() == 4
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert tuple(reversed(tensors["blk.1.ffn_down_exps.weight"].shape.tolist())) == (4, 64, 64)
    logits, greedy = _folder_and_gguf(tiny_moe)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert greedy[0] == greedy[1] and len(set(greedy[0])) > 1


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason=NEEDS_LLAMA_CPP)
def test_llama_cpp_reads_the_moe_gguf_as_the_same_model(tiny_moe):
    from pagedattn.benchmarks.llama_cpp_peer import run_isolated

    tokens = PROMPT * 4
    ours = pagedattn_nll(load_model(str(tiny_moe.hf_dir), "float32", "cpu").model, tokens)
    for kind, tol in (("f16", 0.01), ("q8_0", 0.05)):
        job = {"gguf": str(tiny_moe.gguf(kind)), "tokens": tokens, "threads": 2}
        theirs = run_isolated("nll", job)["nll"]
        assert np.isfinite(theirs) and abs(theirs - ours) < tol * ours, (kind, theirs, ours)
    quant = load_model(str(tiny_moe.gguf("q8_0")), "float32", "cpu").model
    assert abs(pagedattn_nll(quant, tokens) - ours) < 0.05 * ours
