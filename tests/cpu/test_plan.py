"""The kernel tuner picks what it measured fastest, caches it, and every kernel keeps HF's math."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from pagedattn.cpu import extension, tuner
from pagedattn.cpu import plan as plan_module
from pagedattn.cpu.linear import KERNELS, candidates, kernel_available, shares_weights
from pagedattn.cpu.plan import (
    KernelChoiceError,
    KernelOptions,
    KernelPlan,
    ModelShapes,
    choose_plan,
    model_shapes,
)
from pagedattn.cpu.tuner import DECODE_ROWS, PREFILL_ROWS, measure_kernels, tune_linear
from pagedattn.model.layers import Linear, LinearKernels
from pagedattn.model.loader import load_model
from pagedattn.model.text_config import TextConfig
from tests.model.paged_driver import PagedDriver
from tests.model.test_parity import generate_paged, make_prompts
from tests.model.tiny import make_tiny_gemma3, make_tiny_llama

LAYER = ((96, 32), (32, 32), (128, 32), (32, 64))
HEAD = (256, 32)
SHAPES = ModelShapes(LAYER, HEAD, num_heads=4, num_kv_heads=2, head_size=32)


def fp32_kernels() -> list[str]:
    """The float32 candidates now (asked at run time: the extension may load after collection)."""
    return candidates(torch.float32)


# Every candidate there could be (tables answer for all, whatever this machine offers).
ALL = (*KERNELS,)


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    """Each test gets its own plan cache, a quiet machine and one thread (so no thread-count
    measurement, unless the test asks for more threads)."""
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuner, "machine_busy", lambda: False)
    monkeypatch.delenv("PAGEDATTN_RETUNE", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def choose(measure=None, shapes=SHAPES, dtype=torch.float32, attention=None, **options):
    return choose_plan(shapes, dtype, KernelOptions(**options), attention, measure_linear=measure)


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
    if len(fp32_kernels()) < 2:
        pytest.skip("one linear kernel: nothing is measured")
    torch.set_num_threads(2)
    plan = choose(threaded_measure({1: one, 2: two}))
    assert plan.threads == chosen
    assert torch.get_num_threads() == 2  # measuring on one thread leaves the setting alone


def test_busy_machine_measures_no_thread_count(monkeypatch):
    monkeypatch.setattr(tuner, "machine_busy", lambda: True)
    torch.set_num_threads(2)
    assert choose(threaded_measure({1: 1.0, 2: 2.0})).threads == 0


def test_attention_kernel_is_measured_and_the_fastest_chosen():
    table = {r: dict.fromkeys(ALL, 1.0) for r in (DECODE_ROWS, PREFILL_ROWS)}
    seen = []

    def slow_compiled(kernels, dtype):
        seen.append(list(kernels))
        return {k: 2.0 if k == "compiled" else 1.0 for k in kernels}

    plan = choose(fake_measure(table), attention=slow_compiled)
    usable = [
        k for k in ("compiled", "amx", "torch") if plan_module.attention_available(k, torch.float32)
    ]
    if len(usable) > 1:
        assert seen == [usable] and plan.attention == "torch"
        assert "decode attention torch" in plan.describe()
    else:
        assert plan.attention == usable[0]


def test_forced_torch_attention_runs_decode_on_pytorch(tmp_path):
    path = make_tiny_llama(tmp_path)
    plan = choose(attention_kernel="torch", linear_kernel="torch")
    model = load_model(str(path), "float32", "cpu", "cpu", plan=plan).model
    backend = model.model.layers[0].self_attn.attn.backend
    assert not backend.uses_compiled_decode
    assert model.decode_stack is None


def test_a_kernel_this_cpu_cannot_run_is_an_error_naming_what_can():
    if plan_module.attention_available("amx", torch.float32):
        pytest.skip("amx attention runs float32 here")
    with pytest.raises(KernelChoiceError, match="attention kernel 'amx' cannot run float32"):
        choose(attention_kernel="amx")
    if not plan_module.get_linear_kernel("amx").available(torch.float32):
        with pytest.raises(KernelChoiceError, match="linear kernel 'amx' cannot run float32"):
            choose(linear_kernel="amx")
    with pytest.raises(ValueError, match="linear_kernel='fastest' is invalid"):
        KernelOptions(linear_kernel="fastest")
    with pytest.raises(ValueError, match="add quantization='int8'"):
        KernelOptions(linear_kernel="int8")


def test_model_shapes_come_from_the_config_alone():
    config = TextConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
    )
    shapes = model_shapes(config)
    # fused qkv (4 + 2 * 2 heads of 16), o, fused gate/up, down; per layer; then the head
    assert shapes.layers == ((128, 64), (64, 64), (192, 64), (64, 96)) * 2
    assert shapes.head == (100, 64) and shapes.head_size == 16


def fake_measure(table: dict[int, dict[str, float]], calls: list | None = None):
    """A Measure that answers from ``table`` (rows -> kernel -> seconds)."""

    def measure(kernels, shapes, rows):
        if calls is not None:
            calls.append((tuple(kernels), rows))
        return {k: table[rows][k] for k in kernels}

    return measure


def test_tuner_picks_the_fastest_kernel_per_regime():
    table = {
        DECODE_ROWS: {"panels": 1.0, "amx": 6.0, "mkl": 2.0, "onednn": 3.0, "torch": 4.0},
        PREFILL_ROWS: {"panels": 9.0, "amx": 6.0, "mkl": 5.0, "onednn": 2.0, "torch": 3.0},
        64: dict.fromkeys(ALL, 1.0) | {"onednn": 1.5},
        128: dict.fromkeys(ALL, 2.0) | {"onednn": 1.9},  # onednn starts winning at 128 rows
        256: dict.fromkeys(ALL, 4.0) | {"onednn": 2.0},
    }
    plan = choose(fake_measure(table), shapes=SHAPES._replace(layers=LAYER * 3))
    kernels = fp32_kernels()
    if len(kernels) < 2:
        assert plan.linear_decode == plan.linear_prefill == kernels[0]
        return
    expected_decode = min(kernels, key=lambda k: table[DECODE_ROWS][k])
    expected_prefill = min(kernels, key=lambda k: table[PREFILL_ROWS][k])
    assert plan.linear_decode == expected_decode
    assert plan.linear_prefill == expected_prefill
    assert plan.linear_head == expected_decode  # the head is timed at decode rows
    if expected_decode != expected_prefill and {expected_prefill} == {"onednn"}:
        assert plan.prefill_rows == 128


@pytest.mark.parametrize(
    "torch_prefill, expected", [(2.05, "torch"), (2.5, "onednn")], ids=["within", "past"]
)
def test_prefill_keeps_the_decode_kernels_weights_unless_another_is_clearly_faster(
    torch_prefill, expected
):
    # MKL keeps the plain weight, which F.linear runs on: a prefill on F.linear costs no copy,
    # while oneDNN's reorder is another copy of every weight. Within 5% F.linear is taken.
    table = {
        DECODE_ROWS: {"mkl": 1.0, "onednn": 1.4, "torch": 1.2},
        PREFILL_ROWS: {"mkl": 3.0, "onednn": 2.0, "torch": torch_prefill},
        **{rows: {"mkl": 1.0, "onednn": 0.5, "torch": 0.5} for rows in (64, 128, 256)},
    }
    choice, _ = tune_linear(LAYER, (100, 64), torch.float32, ["mkl", "onednn", "torch"],
                            fake_measure(table))  # fmt: skip
    assert (choice.decode, choice.prefill) == ("mkl", expected)
    assert shares_weights("torch", "mkl") and not shares_weights("onednn", "mkl")
    assert shares_weights("panels", "panels") and not shares_weights("torch", "panels")


def test_same_winner_needs_no_split_measurement():
    table = {r: dict.fromkeys(ALL, 3.0) | {"torch": 1.0} for r in (DECODE_ROWS, PREFILL_ROWS)}
    calls: list = []
    plan = choose(fake_measure(table, calls))
    assert (plan.linear_decode, plan.linear_prefill, plan.linear_head) == ("torch",) * 3
    if len(fp32_kernels()) > 1:
        assert [rows for _, rows in calls] == [DECODE_ROWS, PREFILL_ROWS, DECODE_ROWS]


def test_plan_is_cached_and_retune_measures_again(monkeypatch, capsys):
    if len(fp32_kernels()) < 2:
        pytest.skip("one linear kernel: nothing is measured or cached")
    table = {r: dict.fromkeys(ALL, 1.0) | {"torch": 0.5} for r in (DECODE_ROWS, PREFILL_ROWS)}
    calls: list = []
    plan = choose(fake_measure(table, calls))
    assert plan.linear_decode == "torch" and len(calls) == 3
    assert "linear torch, decode attention" in capsys.readouterr().err

    def must_not_measure(kernels, shapes, rows):
        raise AssertionError("a cached plan was measured again")

    assert choose(must_not_measure) == plan
    # Other shapes are another entry.
    other = choose(fake_measure(table, calls), shapes=SHAPES._replace(layers=((64, 32),)))
    assert other == plan and len(calls) == 6

    # Another build of the extension (its kernels changed) is measured again.
    with monkeypatch.context() as patch:
        patch.setattr(plan_module.extension, "build_key", lambda isa: "another-build")
        assert choose(fake_measure(table, calls)) == plan and len(calls) == 9
        assert choose(must_not_measure) == plan
    assert choose(must_not_measure) == plan

    monkeypatch.setenv("PAGEDATTN_RETUNE", "1")
    slow_torch = {r: dict.fromkeys(ALL, 1.0) | {"torch": 9.0} for r in (DECODE_ROWS, PREFILL_ROWS)}
    retuned = choose(fake_measure(slow_torch))
    assert retuned.linear_decode == fp32_kernels()[0] != "torch"
    monkeypatch.delenv("PAGEDATTN_RETUNE")
    assert choose(must_not_measure) == retuned


def test_busy_machine_measures_on_one_thread_and_again_when_quiet(monkeypatch, capsys):
    if len(fp32_kernels()) < 2:
        pytest.skip("one linear kernel: nothing is measured")
    table = {r: dict.fromkeys(ALL, 1.0) | {"torch": 0.5} for r in (DECODE_ROWS, PREFILL_ROWS)}
    seen_threads: list[int] = []

    def measure(kernels, shapes, rows):
        seen_threads.append(torch.get_num_threads())
        return {k: table[rows][k] for k in kernels}

    threads = torch.get_num_threads()
    monkeypatch.setattr(tuner, "machine_busy", lambda: True)
    choose(measure)
    assert set(seen_threads) == {1} and torch.get_num_threads() == threads
    assert "on 1 thread, the machine being busy" in capsys.readouterr().err
    choose(measure)  # still busy: the plan stands
    assert len(seen_threads) == 3
    monkeypatch.setattr(tuner, "machine_busy", lambda: False)
    choose(measure)  # quiet: measured again, all threads
    assert seen_threads[3:] == [threads] * 3
    choose(measure)
    assert len(seen_threads) == 6


@pytest.mark.parametrize("forced", KERNELS)
def test_forced_kernel_skips_measuring_and_is_used(tmp_path, forced):
    if forced not in fp32_kernels():
        pytest.skip(f"{forced} cannot run float32 on this CPU")

    def must_not_measure(kernels, shapes, rows):
        raise AssertionError("a forced kernel was measured")

    plan = choose(must_not_measure, linear_kernel=forced)
    assert (plan.linear_decode, plan.linear_prefill, plan.linear_head) == (forced,) * 3
    loaded = load_model(str(make_tiny_llama(tmp_path)), "float32", "cpu", "torch", forced)
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and loaded.plan.linear_decode == forced
    if forced == "torch":
        assert all(m.decode is None for m in layers)
    else:
        assert all(m.decode.name == forced for m in layers)  # the untied LM head too


def test_real_measurement_times_every_candidate():
    times = measure_kernels(fp32_kernels(), list(LAYER), 8, torch.float32)
    assert set(times) == set(fp32_kernels())
    assert all(0 < t < 1 for t in times.values())
    assert tuple(tuner.decode_shapes(LAYER * 1000, torch.float32)[: len(LAYER)]) == LAYER


def test_decode_passes_stream_past_the_last_level_cache(monkeypatch):
    """Decode kernels are timed on at least twice the last-level cache's bytes of weights (up to
    the whole model); prefill keeps to DECODE_PASS_BYTES."""
    layer = ((1024, 1024),)  # 4 MiB in float32
    model = layer * 100
    shapes_seen: dict[int, int] = {}

    def measure(kernels, shapes, rows):
        shapes_seen[rows] = max(shapes_seen.get(rows, 0), len(shapes))
        return dict.fromkeys(kernels, 1.0)

    def tuned_counts(llc_bytes: int) -> dict[int, int]:
        shapes_seen.clear()
        monkeypatch.setattr(tuner.features, "last_level_cache_bytes", lambda: llc_bytes)
        tuner.tune_linear(model, (64, 1024), torch.float32, ["torch", "panels"], measure)
        return dict(shapes_seen)

    small = tuned_counts(8 << 20)  # 2 x 8 MiB < DECODE_PASS_BYTES: 24 MiB, 6 layers
    assert small[tuner.DECODE_ROWS] == 6 and small[tuner.PREFILL_ROWS] == 6
    large = tuned_counts(100 << 20)  # 200 MiB: 50 layers
    assert large[tuner.DECODE_ROWS] == 50 and large[tuner.PREFILL_ROWS] == 6
    assert tuned_counts(1 << 30)[tuner.DECODE_ROWS] == 100  # the whole model, no more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_plan_runs_each_kernel_on_its_rows(dtype):
    kernels = candidates(dtype)
    if len(kernels) < 2:
        pytest.skip("one kernel only")
    torch.manual_seed(0)
    # NOTE: shapes every kernel takes (the AMX tiles need K % 32 == 0 and N % 16 == 0).
    ref = nn.Linear(64, 96).to(dtype)
    layer = Linear(64, 96, True, LinearKernels(kernels[0], kernels[1], 8)).to(dtype)
    layer.weight.data, layer.bias.data = ref.weight.detach().clone(), ref.bias.detach().clone()
    with torch.inference_mode():
        few, many = torch.randn(7, 64, dtype=dtype), torch.randn(3, 8, 64, dtype=dtype)
        expected = (ref(few), ref(many))
        layer.process_weights_after_loading()
        assert layer.decode.name == kernels[0] and layer.prefill.name == kernels[1]
        got = (layer(few), layer(many))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == dtype
        torch.testing.assert_close(g.float(), e.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("maker", [make_tiny_llama, make_tiny_gemma3], ids=["llama", "gemma3"])
def test_every_float32_kernel_keeps_hf_greedy_tokens(maker, tmp_path: Path):
    path = maker(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(hf.config.vocab_size)
    attention = [
        k for k in ("compiled", "torch") if plan_module.attention_available(k, torch.float32)
    ]
    fixed = {"decode_stack": True, "step_ops": True}
    plans = [KernelPlan.single(k, attention=attention[0], **fixed) for k in fp32_kernels()]
    # a split plan: prefill chunks and decode rows on different kernels, PyTorch attention
    plans.append(
        KernelPlan(
            fp32_kernels()[0], fp32_kernels()[-1], fp32_kernels()[-1], 4, attention[-1], **fixed
        )
    )
    for plan in plans:
        # The cpu attention backend: Llama's decode steps then run on the compiled decode stack.
        model = load_model(str(path), "float32", "cpu", "cpu", plan=plan).model
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
    assert q8.lm_head.decode.name == "int8"
    assert q8.model.layers[0].mlp.down_proj.decode.name == "int8"
    prompt = make_prompts(128)[0]
    expected = PagedDriver(ref).step([(0, prompt)])[0]
    got = PagedDriver(q8).step([(0, prompt)])[0]
    assert not torch.equal(got, expected)  # the weights really changed
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
    with pytest.raises(ValueError, match="quantization='int4' is invalid"):
        load_model(path, "float32", "cpu", "torch", quantization="int4")


def test_speculation_runs_verify_rows_on_panels_where_decode_chose_another():
    if "panels" not in fp32_kernels() or len(fp32_kernels()) < 2:
        pytest.skip("the panel kernel cannot run float32 here")
    table = {r: dict.fromkeys(ALL, 1.0) | {"torch": 0.5} for r in (DECODE_ROWS, PREFILL_ROWS)}
    plan = choose(fake_measure(table), verify_rows=21)
    assert (plan.linear_decode, plan.linear_verify, plan.verify_rows) == ("torch", "panels", 21)
    assert plan.linear_for(5) == "torch"  # steps without drafts keep the decode kernel
    # The cached plan is the same with or without speculation: only the verify fields differ.
    assert choose(fake_measure(table)).linear_verify is None
    assert choose(linear_kernel="torch", verify_rows=21).linear_verify is None  # forced kernel
    panels = {r: dict.fromkeys(ALL, 1.0) | {"panels": 0.5} for r in (DECODE_ROWS, PREFILL_ROWS)}
    other = SHAPES._replace(layers=((64, 32),))
    on_panels = choose(fake_measure(panels), shapes=other, verify_rows=9)
    assert on_panels.linear_decode == "panels" and on_panels.linear_verify is None
    if kernel_available("dpbf16", torch.bfloat16):  # itself a panel GEMM: no second packing
        dp = {r: dict.fromkeys(ALL, 1.0) | {"dpbf16": 0.5} for r in (DECODE_ROWS, PREFILL_ROWS)}
        on_dp = choose(fake_measure(dp), dtype=torch.bfloat16, verify_rows=9)
        assert on_dp.linear_decode == "dpbf16" and on_dp.linear_verify is None


@pytest.mark.parametrize("kv_cache_dtype", ["u8", "fp8"])
def test_attention_is_timed_on_the_kv_cache_dtype_and_cached_apart(kv_cache_dtype):
    """--kv-cache-dtype reaches the attention timing (the tiles a candidate for u8 and fp8
    caches, where the CPU has AMX), and the plan is cached under its own key, apart from the
    model dtype's."""
    if not plan_module.attention_available("compiled", torch.bfloat16):
        pytest.skip("without the extension only torch attention is left: nothing is timed")
    table = {r: dict.fromkeys(ALL, 1.0) for r in (DECODE_ROWS, PREFILL_ROWS)}
    seen = []

    def measure(kernels, dtype):
        seen.append(list(kernels))
        return {k: 1.0 if k == "torch" else 2.0 for k in kernels}

    choose(fake_measure(table), dtype=torch.bfloat16, attention=measure)
    auto_candidates = seen.pop()
    plan = choose(
        fake_measure(table), dtype=torch.bfloat16, attention=measure, kv_cache_dtype=kv_cache_dtype
    )
    assert plan.attention == "torch" and len(seen) == 1  # measured again: not the auto entry
    amx = plan_module.attention_available("amx", torch.bfloat16)
    assert ("amx" in seen[0]) == amx and ("amx" in auto_candidates) == amx
    assert not plan_module.attention_available("amx", torch.float32, kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "u8", "fp8_e5m2"])
def test_real_attention_timing_on_one_byte_caches(kv_cache_dtype):
    from pagedattn.attention.backends.cpu import time_decode_attention

    kernels = [k for k in ("compiled", "amx", "torch")
               if plan_module.attention_available(k, torch.bfloat16, kv_cache_dtype)]  # fmt: skip
    times = time_decode_attention(
        3, 1, 64, kernels, torch.bfloat16, num_seqs=2, kv_cache_dtype=kv_cache_dtype
    )
    assert set(times) == set(kernels) and all(0 < t < 1 for t in times.values())


def quant_kernels_built() -> bool:
    return hasattr(extension.get_extension(), "QuantLinear")


@pytest.mark.parametrize(("tiles_win_from", "chosen"), [(2, 64), (0, 16), (None, 1024)])
def test_gguf_switch_is_the_first_row_count_where_tiles_win(monkeypatch, tiles_win_from, chosen):
    """tune_quant_rows times dot kernels against tiles at rising row counts and stops at the
    first where the tiles are no slower (twice the last count tried where they never are)."""
    if not quant_kernels_built():
        pytest.skip("no compiled GGUF kernels")
    timed: list[int] = []

    def fake_passes(passes):
        assert set(passes) == {"dot", "tiles"}
        for one_pass in passes.values():
            one_pass()  # the real layers run (shapes and modes are wired up)
        i = len(timed)
        timed.append(i)
        tiles = 0.5 if tiles_win_from is not None and i >= tiles_win_from else 2.0
        return {"dot": 1.0, "tiles": tiles}

    monkeypatch.setattr(tuner, "fastest_passes", fake_passes)
    rows, times = tuner.tune_quant_rows([(96, 64), (64, 512)])
    assert rows == chosen
    stop = len(tuner.QUANT_SPLIT_ROWS) if tiles_win_from is None else tiles_win_from + 1
    # the largest projection, 512 columns: whole Q4_K blocks
    assert list(times) == [f"q4_k_rows_{r}" for r in tuner.QUANT_SPLIT_ROWS[:stop]]


def test_gguf_switch_is_measured_once_per_cpu_and_shape(monkeypatch, capsys):
    calls: list = []

    def fake_tune(layers):
        calls.append(layers)
        return 48, {"q8_0_rows_16": {"dot": 1e-3, "tiles": 2e-3}}

    monkeypatch.setattr(tuner, "tune_quant_rows", fake_tune)
    plan = KernelPlan()
    first = plan_module.with_quant_rows(plan, SHAPES)
    assert first.quant_prefill_rows == 48 and len(calls) == 1
    assert "int8 dot kernels below 48 rows" in capsys.readouterr().err
    assert plan_module.with_quant_rows(plan, SHAPES).quant_prefill_rows == 48 and len(calls) == 1
    plan_module.with_quant_rows(plan, SHAPES._replace(layers=((256, 64),)))
    assert len(calls) == 2
    monkeypatch.setenv("PAGEDATTN_RETUNE", "1")
    plan_module.with_quant_rows(plan, SHAPES)
    assert len(calls) == 3


def test_gguf_switch_real_measurement():
    if not quant_kernels_built():
        pytest.skip("no compiled GGUF kernels")
    rows, times = tuner.tune_quant_rows([(256, 64)])
    assert rows in (*tuner.QUANT_SPLIT_ROWS, 2 * tuner.QUANT_SPLIT_ROWS[-1])
    assert all(0 < t < 1 for ts in times.values() for t in ts.values())
    assert next(iter(times)) == "q8_0_rows_16"  # 64 columns: not whole Q4_K blocks
