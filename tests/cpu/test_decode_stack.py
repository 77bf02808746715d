"""The compiled decode stack gives bit-identical logits to the Python layers, and is used only
where it can."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedattn.cpu import decode_stack as decode_stack_module
from pagedattn.cpu import extension as cpu_ext
from pagedattn.cpu.linear import kernel_available
from pagedattn.cpu.plan import KernelOptions
from pagedattn.cpu.quant import QUANTIZE_TYPES
from pagedattn.model.loader import (
    checkpoint_config,
    choose_model_plan,
    load_model,
    resolve_checkpoint,
)
from pagedattn.model.moe import SparseMoEBlock
from tests.model.paged_driver import PagedDriver
from tests.model.test_moe_parity import make_tiny_mixtral, make_tiny_qwen3_moe
from tests.model.tiny import make_tiny_llama, make_tiny_mistral, make_tiny_qwen2, make_tiny_qwen3

pytestmark = pytest.mark.skipif(
    cpu_ext.get_extension() is None, reason="the compiled CPU extension cannot be built here"
)

# (dtype, linear kernel or quantization) pairs the tuner or the user can pick.
CASES = [
    ("float32", "onednn"),
    ("float32", "panels"),
    ("float32", "mkl"),
    ("float32", "torch"),
    ("bfloat16", "onednn"),
    ("bfloat16", "panels"),
    ("bfloat16", "dpbf16"),
    ("bfloat16", "torch"),
    ("bfloat16", "int8"),
    ("bfloat16", "amx"),
    ("bfloat16", "int8_amx"),
    # GGUF blocks (--quantization q8_0 ...): the stack calls the layers' own QuantLinear.
    ("float32", "q8_0"),
    ("bfloat16", "q4_0"),
]
# Qwen3: per-head q/k norms; Qwen3-MoE (a dense layer among sparse ones) and Mixtral: the fused
# experts in the stack.
MAKERS = [
    make_tiny_llama,
    make_tiny_qwen2,
    make_tiny_mistral,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
    make_tiny_mixtral,
]
PROMPT_LENS = (9, 17, 3)  # several blocks of 4, and one sequence shorter than a block
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """One tiny checkpoint per architecture for the whole module (saving one takes seconds)."""
    root = tmp_path_factory.mktemp("decode-stack")
    return {maker: maker(root) for maker in MAKERS}


def _load(path, dtype: str, kernel: str, **options):
    if kernel in QUANTIZE_TYPES:  # a GGUF block type: the gguf kernel, whatever runs floats
        options = KernelOptions(linear_kernel="torch", quantization=kernel, **options)
    else:
        quantization = "int8" if kernel.startswith("int8") else None
        options = KernelOptions(linear_kernel=kernel, quantization=quantization, **options)
    config = checkpoint_config(resolve_checkpoint(str(path)))
    plan = choose_model_plan(config, getattr(torch, dtype), "cpu", options)
    return load_model(str(path), dtype, "cpu", "cpu", plan=plan).model


def _count_stack_steps(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = decode_stack_module.DecodeStack.forward

    def counted(self, hidden, *args):
        calls.append(hidden.shape[0])
        return real(self, hidden, *args)

    monkeypatch.setattr(decode_stack_module.DecodeStack, "forward", counted)
    return calls


@pytest.mark.parametrize(("dtype", "kernel"), CASES, ids=[f"{d}-{k}" for d, k in CASES])
@pytest.mark.parametrize("maker", MAKERS)
def test_stack_logits_equal_python_layers(checkpoints, monkeypatch, maker, dtype, kernel) -> None:
    name = "gguf" if kernel in QUANTIZE_TYPES else kernel
    if not kernel_available(name, getattr(torch, dtype)):
        pytest.skip(f"{kernel} cannot run {dtype} on this CPU")
    model = _load(checkpoints[maker], dtype, kernel)
    mlp = model.model.layers[0].mlp
    if isinstance(mlp, SparseMoEBlock):  # the fused experts, on the same kernel
        assert mlp.fused is not None and mlp.packed[1][0].name == name
    else:
        assert mlp.down_proj.decode is None or mlp.down_proj.decode.name == name
    stack = model.decode_stack
    assert stack is not None
    calls = _count_stack_steps(monkeypatch)
    with_stack, python = (PagedDriver(model, seed=1, backend="cpu") for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 128, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    chunks = list(enumerate(prompts))
    for step in range(DECODE_STEPS + 1):
        model.decode_stack = stack
        got = with_stack.step(chunks)
        model.decode_stack = None
        want = python.step(chunks)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"step {step}: the stack's logits differ"
        chunks = [(s, [int(g[-1].argmax())]) for s, g in enumerate(got)]
    # The prompt step mixes prefill rows: Python layers; every decode step: the stack.
    assert calls == [len(PROMPT_LENS)] * DECODE_STEPS


def test_prefill_rows_and_wide_batches_stay_on_python_layers(checkpoints, monkeypatch) -> None:
    model = _load(checkpoints[make_tiny_llama], "float32", "torch")
    calls = _count_stack_steps(monkeypatch)
    model.decode_stack.max_rows = 3  # as if the plan switched to its prefill kernel at 3 rows
    driver = PagedDriver(model, backend="cpu")
    driver.step([(0, [5, 6, 7]), (1, [8])])  # a prefill row: never the stack
    driver.step([(0, [9]), (1, [10])])  # 2 decode rows: the stack
    driver.step([(0, [11]), (1, [12]), (2, [13])])  # 3 rows: the prefill kernel's, Python
    assert calls == [2]


def test_no_stack_where_it_could_not_match(checkpoints, monkeypatch) -> None:
    llama = checkpoints[make_tiny_llama]
    assert _load(llama, "float32", "torch").decode_stack is not None
    assert _load(llama, "float32", "torch", decode_stack=False).decode_stack is None
    assert _load(llama, "float32", "torch", step_ops=False).decode_stack is None
    assert _load(llama, "float32", "torch", attention_kernel="torch").decode_stack is None
    # The torch attention backend (classic layout) is not the extension's decode kernel.
    assert load_model(str(llama), "float32", "cpu", "torch").model.decode_stack is None


def test_kv_cache_in_another_dtype_runs_python_layers(checkpoints, monkeypatch) -> None:
    model = _load(checkpoints[make_tiny_llama], "float32", "torch")
    calls = _count_stack_steps(monkeypatch)
    driver = PagedDriver(model, backend="cpu")
    driver.kv_caches = [(k.bfloat16(), v.bfloat16()) for k, v in driver.kv_caches]
    driver.step([(0, [5, 6, 7])])
    driver.step([(0, [8])])
    assert calls == []


def test_verify_steps_run_the_verify_stack_on_the_verify_kernel(checkpoints, monkeypatch) -> None:
    if not kernel_available("panels", torch.float32):
        pytest.skip("the panel kernel cannot run float32 here")
    path = checkpoints[make_tiny_llama]
    config = checkpoint_config(resolve_checkpoint(str(path)))
    plan = choose_model_plan(config, torch.float32, "cpu", KernelOptions(linear_kernel="torch"))
    plan = dataclasses.replace(plan, linear_verify="panels", verify_rows=4)
    model = load_model(str(path), "float32", "cpu", "cpu", plan=plan).model
    assert model.model.layers[0].mlp.down_proj.verify.name == "panels"
    assert model.tied_head_verify is not None or model.lm_head.verify is not None
    stacks = (model.decode_stack, model.verify_stack)
    assert None not in stacks and stacks[0] is not stacks[1]
    used: list[tuple[int, bool]] = []
    real = decode_stack_module.DecodeStack.forward

    def counted(self, hidden, *args):
        used.append((hidden.shape[0], self is stacks[1]))
        return real(self, hidden, *args)

    monkeypatch.setattr(decode_stack_module.DecodeStack, "forward", counted)
    with_stack, python = (PagedDriver(model, backend="cpu") for _ in range(2))
    three = [(0, [11]), (1, [12]), (2, [13])]
    steps = [([(0, [5, 6, 7]), (1, [8, 9])], True), ([(0, [10])], True), (three, True)]
    steps += [(three, False), ([(0, [14]), (1, [15]), (2, [16]), (3, [17])], True)]
    for chunks, verifies in steps:
        model.decode_stack, model.verify_stack = stacks
        got = with_stack.step(chunks, verifies)
        model.decode_stack = model.verify_stack = None
        want = python.step(chunks)  # the Python layers: the decode kernel, torch here
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    # A prefill step: the Python layers; a verify step of 2 .. 3 rows: the verify stack; one
    # row, a step without drafts and a verify step of 4 rows: the decode stack.
    assert used == [(1, False), (3, True), (3, False), (4, False)]
    model.decode_stack = None  # no decode stack: no verify stack either
    with_stack.step(three, True)
    assert len(used) == 4


@pytest.mark.parametrize("rows", [1, 2])
def test_helpers_fetching_the_next_weights_change_no_logit(tmp_path, rows) -> None:
    # At 1-2 rows the AMX linears read their weights with dot products, and while the stack runs
    # the small ops between them the other threads fetch the next linear's first work items and
    # then multiply them (DotWarmup): the logits must not change, only who computes what.
    if not kernel_available("amx", torch.bfloat16):
        pytest.skip("no AMX on this CPU")
    # Wide enough that every linear has 2+ work items of 128 columns (helpers take at most half).
    path = make_tiny_llama(tmp_path, hidden_size=256, intermediate_size=512, head_dim=64)
    model = _load(path, "bfloat16", "amx")
    stack = model.decode_stack
    compiled = stack.compiled
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        modes = ("warm", "cold", "python")
        drivers = {mode: PagedDriver(model, seed=1, backend="cpu") for mode in modes}
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(5, 128, (n,), generator=gen).tolist() for n in (9, 17)[:rows]]
        chunks = {mode: list(enumerate(prompts)) for mode in drivers}
        for _ in range(DECODE_STEPS + 1):
            logits = {}
            for mode, driver in drivers.items():
                compiled.warm_ahead = mode == "warm"
                model.decode_stack = None if mode == "python" else stack
                logits[mode] = driver.step(chunks[mode])
                chunks[mode] = [(s, [int(g[-1].argmax())]) for s, g in enumerate(logits[mode])]
            for warm, cold, python in zip(*logits.values(), strict=True):
                assert torch.equal(warm, cold) and torch.equal(warm, python)
        assert compiled.warmed_items > 0  # the helpers did take items
    finally:
        torch.set_num_threads(threads)
        compiled.warm_ahead = True
        model.decode_stack = stack
