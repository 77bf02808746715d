"""The kernel tuner picks what it measured fastest, caches it, and every kernel keeps HF's math."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from pagedattn.cpu import extension as cpu_ext
from pagedattn.model import kernel_tuner
from pagedattn.model.kernel_tuner import (
    DECODE_ROWS,
    PREFILL_ROWS,
    candidates,
    measure_kernels,
    plan_for_shapes,
    tune,
)
from pagedattn.model.loader import load_model
from pagedattn.model.packed_linear import LinearPlan, pack_linear_layers
from tests.model.paged_driver import PagedDriver
from tests.model.test_parity import generate_paged, make_prompts
from tests.model.tiny import make_tiny_gemma3, make_tiny_llama

LAYER = [(96, 32), (32, 32), (128, 32), (32, 64)]
HEAD = (256, 32)
FP32_KERNELS = candidates(torch.float32)


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    """Each test gets its own plan cache, no forced kernel, a quiet machine and one thread (so
    no thread-count measurement, unless the test asks for more threads)."""
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_tuner, "machine_busy", lambda: False)
    monkeypatch.delenv("PAGEDATTN_LINEAR", raising=False)
    monkeypatch.delenv("PAGEDATTN_RETUNE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def threaded_measure(per_thread: dict[int, float]):
    """A Measure whose every kernel takes per_thread[torch threads] seconds."""

    def measure(kernels, shapes, rows):
        return dict.fromkeys(kernels, per_thread[torch.get_num_threads()])

    return measure


@pytest.mark.parametrize(
    ("one", "two", "chosen"), [(1.0, 2.0, 1), (2.0, 1.0, 2), (1.0, 1.0, 2), (0.95, 1.0, 2)]
)
def test_thread_count_is_measured_and_one_thread_kept_only_when_it_wins(one, two, chosen):
    # 0.95 against 1.0: one thread 5% faster is within a busy moment's noise, so all threads stay.
    torch.set_num_threads(2)
    result = tune(LAYER, HEAD, torch.float32, threaded_measure({1: one, 2: two}))
    assert result.plan.threads == chosen
    assert result.times["threads_decode"] == {"2": two, "1": one}
    assert torch.get_num_threads() == 2  # measuring on one thread leaves the setting alone


def test_busy_machine_measures_no_thread_count(monkeypatch):
    monkeypatch.setattr(kernel_tuner, "machine_busy", lambda: True)
    torch.set_num_threads(2)
    result = tune(LAYER, HEAD, torch.float32, threaded_measure({1: 1.0, 2: 2.0}))
    assert result.plan.threads == 0 and "threads_decode" not in result.times


def test_attention_kernel_is_measured_and_the_fastest_chosen(monkeypatch):
    shape = kernel_tuner.AttentionShape(num_heads=4, num_kv_heads=2, head_size=32)
    table = {r: dict.fromkeys(FP32_KERNELS, 1.0) for r in (DECODE_ROWS, PREFILL_ROWS)}
    result = tune(LAYER, HEAD, torch.float32, fake_measure(table), attention=shape)
    times = result.times["attention"]
    assert "torch" in times and all(t > 0 for t in times.values())
    assert result.plan.attention == min(times, key=times.get)
    slow_compiled = {"compiled": 2.0, "torch": 1.0}
    monkeypatch.setattr(kernel_tuner, "measure_attention", lambda shape, dtype: slow_compiled)
    result = tune(LAYER, HEAD, torch.float32, fake_measure(table), attention=shape)
    assert result.plan.attention == "torch"
    assert "decode attention torch" in result.plan.describe()


def test_plan_with_torch_attention_runs_decode_on_pytorch(tmp_path, monkeypatch):
    monkeypatch.setattr(
        kernel_tuner,
        "plan_for_model",
        lambda model: LinearPlan.single("torch")._replace(attention="torch"),
    )
    model = load_model(str(make_tiny_llama(tmp_path)), "float32", "cpu", "cpu").model
    backend = model.model.layers[0].self_attn.attn.backend
    assert backend.uses_extension == (cpu_ext.get_extension() is not None)
    assert not backend.uses_compiled_decode
    assert model.decode_stack is None


def fake_measure(table: dict[int, dict[str, float]], calls: list | None = None):
    """A Measure that answers from ``table`` (rows -> kernel -> seconds)."""

    def measure(kernels, shapes, rows):
        if calls is not None:
            calls.append((tuple(kernels), rows))
        return {k: table[rows][k] for k in kernels}

    return measure


def test_tuner_picks_the_fastest_kernel_per_regime():
    table = {
        DECODE_ROWS: {"panels": 1.0, "mkl": 2.0, "onednn": 3.0, "torch": 4.0},
        PREFILL_ROWS: {"panels": 9.0, "mkl": 5.0, "onednn": 2.0, "torch": 3.0},
        64: {"panels": 1.0, "onednn": 1.5},
        128: {"panels": 2.0, "onednn": 1.9},  # onednn starts winning at 128 rows
        256: {"panels": 4.0, "onednn": 2.0},
    }
    # The head (measured at decode rows) follows the decode table.
    result = tune(LAYER * 3, HEAD, torch.float32, fake_measure(table))
    kernels = candidates(torch.float32)
    expected_decode = min(kernels, key=lambda k: table[DECODE_ROWS][k])
    expected_prefill = min(kernels, key=lambda k: table[PREFILL_ROWS][k])
    assert result.plan.decode == expected_decode
    assert result.plan.prefill == expected_prefill
    assert result.plan.head == expected_decode
    if {"panels", "onednn"} <= set(kernels):
        assert result.plan == LinearPlan("panels", "onednn", "panels", 128)
    assert set(result.times["decode"]) == set(kernels)


def test_same_winner_needs_no_split_measurement():
    table = {
        r: {"panels": 3.0, "mkl": 3.0, "onednn": 3.0, "torch": 1.0}
        for r in (DECODE_ROWS, PREFILL_ROWS)
    }
    calls: list = []
    result = tune(LAYER, HEAD, torch.float32, fake_measure(table, calls))
    assert result.plan == LinearPlan("torch", "torch", "torch")
    assert [rows for _, rows in calls] == [DECODE_ROWS, PREFILL_ROWS, DECODE_ROWS]


def test_plan_is_cached_and_retune_measures_again(monkeypatch, capsys):
    table = {
        r: {k: (0.5 if k == "torch" else 1.0) for k in FP32_KERNELS}
        for r in (DECODE_ROWS, PREFILL_ROWS)
    }
    calls: list = []
    plan = plan_for_shapes(LAYER, HEAD, torch.float32, fake_measure(table, calls))
    assert plan == LinearPlan.single("torch") and len(calls) == 3
    assert "linear torch (measured in" in capsys.readouterr().err

    def must_not_measure(kernels, shapes, rows):
        raise AssertionError("a cached plan was measured again")

    assert plan_for_shapes(LAYER, HEAD, torch.float32, must_not_measure) == plan
    # Another dtype or other shapes are another entry.
    other = plan_for_shapes([(64, 32)], HEAD, torch.float32, fake_measure(table, calls))
    assert other == plan and len(calls) == 6

    monkeypatch.setenv("PAGEDATTN_RETUNE", "1")
    slow_torch = {
        r: {k: (9.0 if k == "torch" else 1.0) for k in FP32_KERNELS}
        for r in (DECODE_ROWS, PREFILL_ROWS)
    }
    retuned = plan_for_shapes(LAYER, HEAD, torch.float32, fake_measure(slow_torch))
    assert retuned.decode == FP32_KERNELS[0] != "torch"
    monkeypatch.delenv("PAGEDATTN_RETUNE")
    assert plan_for_shapes(LAYER, HEAD, torch.float32, must_not_measure) == retuned


def test_busy_machine_measures_on_one_thread_and_again_when_quiet(monkeypatch, capsys):
    table = {
        r: {k: (0.5 if k == "torch" else 1.0) for k in FP32_KERNELS}
        for r in (DECODE_ROWS, PREFILL_ROWS)
    }
    seen_threads: list[int] = []

    def measure(kernels, shapes, rows):
        seen_threads.append(torch.get_num_threads())
        return {k: table[rows][k] for k in kernels}

    threads = torch.get_num_threads()
    monkeypatch.setattr(kernel_tuner, "machine_busy", lambda: True)
    plan_for_shapes(LAYER, HEAD, torch.float32, measure)
    assert set(seen_threads) == {1} and torch.get_num_threads() == threads
    assert "on 1 thread, the machine being busy" in capsys.readouterr().err
    plan_for_shapes(LAYER, HEAD, torch.float32, measure)  # still busy: the plan stands
    assert len(seen_threads) == 3
    monkeypatch.setattr(kernel_tuner, "machine_busy", lambda: False)
    plan_for_shapes(LAYER, HEAD, torch.float32, measure)  # quiet: measured again, all threads
    assert seen_threads[3:] == [threads] * 3
    plan_for_shapes(LAYER, HEAD, torch.float32, measure)
    assert len(seen_threads) == 6


def test_forced_kernel_skips_measuring_and_is_used(monkeypatch, tmp_path):
    forced = FP32_KERNELS[0]
    monkeypatch.setenv("PAGEDATTN_LINEAR", forced)

    def must_not_measure(kernels, shapes, rows):
        raise AssertionError("a forced kernel was measured")

    assert plan_for_shapes(LAYER, HEAD, torch.float32, must_not_measure) == LinearPlan.single(
        forced
    )
    model = load_model(str(make_tiny_llama(tmp_path)), "float32", "cpu", "torch").model
    head = getattr(model, "lm_head", None)  # untied: packed as the LM head, not as a layer
    layers = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    assert layers
    if forced == "torch":
        assert all(not hasattr(m, "linear_decode") for m in layers)
    else:
        assert all(m.linear_decode.kernel == forced for m in layers)
        assert model._lm_head.kernel == forced
    assert model.linear_plan == LinearPlan.single(forced)
    monkeypatch.setenv("PAGEDATTN_LINEAR", "fastest")
    with pytest.raises(ValueError, match="PAGEDATTN_LINEAR='fastest' is invalid"):
        plan_for_shapes(LAYER, HEAD, torch.float32, must_not_measure)


def test_real_measurement_times_every_candidate():
    times = measure_kernels(FP32_KERNELS, LAYER, 8, torch.float32)
    assert set(times) == set(FP32_KERNELS)
    assert all(0 < t < 1 for t in times.values())
    assert kernel_tuner.decode_shapes(LAYER * 1000, torch.float32)[: len(LAYER)] == LAYER


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_plan_runs_each_kernel_on_its_rows(dtype):
    kernels = candidates(dtype)
    if len(kernels) < 2:
        pytest.skip("one kernel only")
    torch.manual_seed(0)
    # NOTE: shapes every kernel takes (the AMX tiles need K % 32 == 0 and N % 16 == 0).
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(dtype)
    plan = LinearPlan(kernels[0], kernels[1], kernels[0], prefill_rows=8)
    with torch.inference_mode():
        few, many = torch.randn(7, 64, dtype=dtype), torch.randn(3, 8, 64, dtype=dtype)
        expected = (model(few), model(many))
        assert pack_linear_layers(model, plan) == 2
        assert model[0].linear_decode.kernel == kernels[0]
        assert model[0].linear_prefill.kernel == kernels[1]
        assert model[0].weight.numel() == 0
        got = (model(few), model(many))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == dtype
        torch.testing.assert_close(g.float(), e.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("maker", [make_tiny_llama, make_tiny_gemma3], ids=["llama", "gemma3"])
def test_every_float32_kernel_keeps_hf_greedy_tokens(maker, tmp_path: Path):
    path = maker(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size)
    plans = [LinearPlan.single(k) for k in FP32_KERNELS]
    if len(FP32_KERNELS) >= 2:  # a split plan: prefill chunks and decode rows on different kernels
        plans.append(LinearPlan(FP32_KERNELS[0], FP32_KERNELS[-2], FP32_KERNELS[-1], 4))
    for plan in plans:
        # NOTE: "torch" leaves every weight as loaded, so the model can be packed with the plan.
        # The cpu attention backend: Llama's decode steps then run on the compiled decode stack.
        model = load_model(str(path), "float32", "cpu", "cpu", linear_kernel="torch").model
        model.pack_for_cpu(plan)
        tokens, logits = generate_paged(model, prompts, block_size=4, backend="cpu")
        for prompt, seq, rows in zip(prompts, tokens, logits, strict=True):
            with torch.no_grad():
                ref = hf(torch.tensor([seq[:-1]])).logits[0].float()  # [len - 1, V]
            torch.testing.assert_close(rows, ref, atol=1e-4, rtol=1e-4, msg=str(plan))
            assert seq[len(prompt) :] == ref[len(prompt) - 1 :].argmax(-1).tolist(), plan


def test_int8_quantized_model_tracks_float32(tmp_path: Path):
    path = str(make_tiny_llama(tmp_path))
    ref = load_model(path, "float32", "cpu", "torch", linear_kernel="torch").model
    q8 = load_model(path, "float32", "cpu", "torch", quantization="int8").model
    assert q8.linear_plan == LinearPlan.single("int8") and q8._lm_head.kernel == "int8"
    prompt = make_prompts(128)[0]
    expected = PagedDriver(ref).step([(0, prompt)])[0]
    got = PagedDriver(q8).step([(0, prompt)])[0]
    assert not torch.equal(got, expected)  # the weights really changed
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    with pytest.raises(ValueError, match="quantization='int4' is invalid"):
        load_model(path, "float32", "cpu", "torch", quantization="int4")
