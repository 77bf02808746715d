"""GGUF weights run as stored (the gguf kernel) against the same file dequantised.

The shipped SmolLM2-135M Q4_1 file (Q4_1 projections, a Q8_0 tied embedding) and the Gemma 3
270M Q4_K_M file (Q5_0, Q8_0, Q4_K, Q6_K). As stored, decode rows quantise their activations
to int8 per block (as llama.cpp does), so logits are close to the dequantised model's, not
equal: the test compares prefill logits (tiles dequantised into at::mm: equal up to summation
order), decode logits within a tolerance, and greedy tokens over a few steps.
"""

from __future__ import annotations

import pytest
import torch

from pagedattn.cpu import extension
from pagedattn.model import load_model
from pagedattn.model.gguf_file import GGUFFile
from pagedattn.model.layers import Embedding, Linear
from pagedattn.model.loader import packaged_model_path
from tests.model.paged_driver import PagedDriver

pytestmark = pytest.mark.skipif(
    extension.get_extension() is None, reason="the gguf kernel needs the compiled extension"
)
NUM_STEPS = 4


def held_block_bytes(model: torch.nn.Module) -> int:
    """Bytes of the GGUF blocks the model computes on, as its compiled layers hold them (Q4_K
    and Q6_K repacked, the rest as stored), plus the embedding table: each once."""
    total = sum(
        m.decode.a.nbytes()
        for m in model.modules()
        if isinstance(m, Linear) and m.decode is not None and m.decode.name == "gguf"
    )
    for m in model.modules():
        if isinstance(m, Embedding) and m.quantized is not None:
            # a tied head's layer holds the table (the lookups read it there)
            total += m.lookup.nbytes() if m.lookup is not None else m.quantized.data.numel()
    return total


def float_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def greedy(
    model: torch.nn.Module, prompt: list[int], forced: list[int] | None = None
) -> tuple[torch.Tensor, list, list[int]]:
    """(prefill logits, decode logits per step, greedy tokens) over NUM_STEPS steps; with
    ``forced``, each step is fed those tokens instead of its own (the same context as theirs)."""
    driver = PagedDriver(model, block_size=16)
    prefill = driver.step([(0, prompt)])[0]
    tokens, decode = [int(prefill[-1].argmax())], []
    for i in range(NUM_STEPS):
        fed = tokens[-1] if forced is None else forced[i]
        logits = driver.step([(0, [fed])])[0][-1]
        decode.append(logits)
        tokens.append(int(logits.argmax()))
    return prefill, decode, tokens


@pytest.mark.parametrize(
    ("name", "types"),
    [("smollm2-135m", {"Q4_1", "Q8_0"}), ("gemma3-270m", {"Q5_0", "Q8_0", "Q4_K", "Q6_K"})],
)
def test_packaged_gguf_runs_as_stored(name, types, capsys):
    stored = load_model(name, "float32", "cpu", "torch")
    assert "[weights]" in capsys.readouterr().err
    model = stored.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.decode.name == "gguf" and m.weight is None for m in linears)
    assert model.model.embed_tokens.quantized is not None
    assert stored.plan.linear_quant == "gguf"
    held = {p.name for m in linears for p in m.decode.b.parts}
    assert held | {model.model.embed_tokens.quantized.name} == types

    # Weights held once: the blocks the model computes on are the file's quantised tensors
    # (Q4_K's interleaved copy 2.8% larger, its rows as stored dropped), and the float
    # parameters left are the norms.
    file = GGUFFile(packaged_model_path(name))
    file_bytes = sum(t.num_bytes for t in file.tensors if len(t.shape) == 2)
    blocks = held_block_bytes(model)
    assert abs(blocks - file_bytes) <= 0.1 * file_bytes
    assert float_bytes(model) < 0.01 * file_bytes

    text = (
        "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain "
        "is Madrid. The capital of Portugal is Lisbon. The capital of Italy is"
    )
    # Every layer switches to dequantised tiles where the plan measured it; the prompt is long
    # enough to run them, the decode steps run the int8 dot kernels. Both multiply int8
    # activations (as llama.cpp does), so they are close to the dequantised model, not equal.
    tiles_from = stored.plan.quant_prefill_rows
    assert {m.decode.a.prefill_rows for m in linears} == {tiles_from}
    prompt = stored.tokenizer.encode(text)
    prompt = (prompt * (tiles_from // len(prompt) + 1))[:tiles_from]
    dense = load_model(name, "float32", "cpu", "torch", weights="dequantize").model
    assert all(
        m.decode is None or m.decode.name != "gguf"
        for m in dense.modules()
        if isinstance(m, Linear)
    )
    ref, ref_decode, ref_tokens = greedy(dense, prompt)
    # NOTE: fed the dense model's tokens: int8 activations may flip a close greedy token, and
    # the steps after it would compare different contexts.
    ours, ours_decode, ours_tokens = greedy(model, prompt, forced=ref_tokens)
    # NOTE: the direction of each position's logits, not the largest element: which logit
    # moves most with int8 activations depends on the prompt, whose length is the measured tile
    # switch (16-256 rows; over those, SmolLM2 and Gemma 3: mean >= 0.99, worst position 0.968).
    logits = torch.cat((ours, torch.stack(ours_decode))), torch.cat((ref, torch.stack(ref_decode)))
    cosine = torch.nn.functional.cosine_similarity(*logits)
    assert cosine.mean() > 0.99 and cosine.min() > 0.95
    agree = sum(a == b for a, b in zip(ours_tokens, ref_tokens, strict=True))
    assert agree >= len(ref_tokens) - 1, (ours_tokens, ref_tokens)


def test_bfloat16_activations_on_blocks():
    loaded = load_model(None, "bfloat16", "cpu", "torch")
    prompt = loaded.tokenizer.encode("Hello")
    logits = PagedDriver(loaded.model, block_size=16).step([(0, prompt)])[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert loaded.model.dtype == torch.bfloat16


def test_a_file_of_blocks_measures_no_float_linear_kernel(monkeypatch, tmp_path, capsys):
    """Every matrix of the packaged file runs on the gguf kernel: timing float kernels on random
    weights of its shapes would cost the first start a minute (1B) for nothing."""
    from pagedattn.cpu import tuner

    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path))  # no plan cached
    monkeypatch.delenv("PAGEDATTN_RETUNE", raising=False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("float linear kernels were measured for a model of GGUF blocks")

    monkeypatch.setattr(tuner, "tune_linear", must_not_run)
    loaded = load_model("smollm2-135m", "float32", "cpu")
    assert loaded.plan.linear_quant == "gguf" and loaded.plan.linear_decode == "torch"
    assert "linear torch" in capsys.readouterr().err
    # Widened to floats, the same file's layers have float kernels to measure.
    with pytest.raises(AssertionError, match="float linear kernels were measured"):
        load_model("smollm2-135m", "float32", "cpu", weights="dequantize")
