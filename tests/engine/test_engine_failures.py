"""Failure isolation: one request's error ends that request; the engine and the others go on."""

from __future__ import annotations

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.engine.errors import EngineFaultError, InvalidRequestError
from tests.model.tiny import make_tiny_llama

PROMPT = [5, 9, 11, 7, 3, 8, 21, 30, 4, 6]
POISON = 77  # a token id whose presence in a step's batch makes the model fail


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    return LLM(path, dtype="float32", num_blocks=64, block_size=4)


@pytest.fixture
def poisoned_forward(llm):
    """The model raises whenever a step's input ids hold POISON (a fault of one request)."""
    model = llm.engine.runner.model
    forward = model.forward

    def failing_forward(input_ids, *args, **kwargs):
        if (input_ids == POISON).any():
            raise RuntimeError("injected fault")
        return forward(input_ids, *args, **kwargs)

    model.forward = failing_forward
    yield
    model.forward = forward


def _run(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def test_a_request_failing_in_the_forward_fails_alone(llm, poisoned_forward):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([PROMPT], params)[0].outputs[0].token_ids  # before any fault
    engine.add_request("good-1", PROMPT, params)
    engine.add_request("bad", PROMPT[:4] + [POISON] + PROMPT[4:], params)
    engine.add_request("good-2", PROMPT, SamplingParams(temperature=0, max_tokens=6, n=2))
    outputs = _run(engine)
    assert outputs["bad"].error is not None and "injected fault" in outputs["bad"].error
    assert outputs["bad"].outputs[0].finish_reason == "error"
    assert outputs["good-1"].error is None
    assert outputs["good-1"].outputs[0].token_ids == expected
    assert [len(c.token_ids) for c in outputs["good-2"].outputs] == [6, 6]
    stats = engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_failed_requests >= 1
    # The engine goes on serving.
    assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == expected


def test_a_lone_failing_request_fails_and_repeated_faults_stop_the_engine(llm, poisoned_forward):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.add_request("bad", [POISON] + PROMPT, params)
    assert _run(engine)["bad"].error is not None
    assert engine.get_stats().kv_cache_usage == 0.0
    # Three steps in a row in which every request fails: the engine itself is broken.
    with pytest.raises(EngineFaultError):
        for i in range(3):
            engine.add_request(f"bad-{i}", [POISON] + PROMPT, params)
            _run(engine)
    engine.abort_request([f"bad-{i}" for i in range(3)])
    assert engine.get_stats().kv_cache_usage == 0.0


def test_ids_that_look_like_sibling_ids_never_collide(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=3, n=2, ignore_eos=True)
    engine = llm.engine
    engine.add_request("r#1", PROMPT, SamplingParams(temperature=0, max_tokens=3))
    engine.add_request("r", PROMPT, params)
    outputs = _run(engine)
    assert outputs["r#1"].error is None and len(outputs["r"].outputs) == 2
    assert engine.get_stats().kv_cache_usage == 0.0


def test_the_largest_seed_with_n_siblings(llm):
    params = SamplingParams(temperature=1.0, seed=2**63 - 1, max_tokens=3, n=2, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3] and out.error is None
    with pytest.raises((InvalidRequestError, ValueError), match="seed"):
        llm.engine.add_request("big", PROMPT, SamplingParams(seed=2**64 - 1, n=2))
    assert not llm.engine.has_unfinished_requests()


def test_no_max_tokens_is_capped_by_the_pool_not_rejected(tmp_path):
    # 16 blocks of 4 tokens: the tiny model's whole context (256 tokens) would not fit.
    small = LLM(make_tiny_llama(tmp_path), dtype="float32", num_blocks=16, block_size=4)
    assert small.engine.max_model_len > 16 * 4
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = small.generate([PROMPT], params)[0].outputs[0]
    assert len(out.token_ids) == 16 * 4 - len(PROMPT) and out.finish_reason == "length"
    with pytest.raises(InvalidRequestError) as info:
        small.generate([PROMPT * 7], params)
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as info:
        small.generate([PROMPT], SamplingParams(max_tokens=100))
    assert info.value.param == "max_tokens"
