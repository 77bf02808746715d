"""DisaggregatedEngine without Ray: a prefill AsyncLLMEngine behind a stand-in handle, a decode
AsyncLLMEngine that pulls over ZMQ. One stream equal to one engine's; failed prefills retried,
then computed on the decode side; short prompts computed there; no leaks."""

from __future__ import annotations

import asyncio

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.distributed.pd_engine import DisaggregatedEngine, run_prefill
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.kv_transfer.pd import DecodeRole, PrefillRole
from tests.model.tiny import make_tiny_llama

PROMPT = list(range(5, 5 + 70))
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(model_dir):
    return LLM(model_dir, dtype="float32", num_blocks=128, block_size=4).engine


class PrefillHandle:
    """Stands in for the prefill deployment's handle: ``prefill.remote(...)`` is awaitable."""

    def __init__(self, engine: AsyncLLMEngine, role: PrefillRole, failures: int = 0) -> None:
        self.engine, self.role, self.failures, self.num_calls = engine, role, failures, 0
        self.prefill = self

    def remote(self, request_id, prompt, params, cache_salt, priority, routing_hashes=None):
        self.num_calls += 1
        assert len(routing_hashes) == len(prompt) // 4  # the prefix router's input
        if self.num_calls <= self.failures:
            return asyncio.ensure_future(self._die())
        coro = run_prefill(self.engine, self.role, request_id, prompt, params, cache_salt)
        return asyncio.ensure_future(coro)

    async def _die(self):
        raise RuntimeError("ActorDiedError: the prefill replica died")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def single(model_dir):
    out = _engine(model_dir)
    out.add_request("s", PROMPT, PARAMS)
    while out.has_unfinished_requests():
        for o in out.step():
            final = o
    return final.outputs[0]


@pytest.fixture
def setup(model_dir):
    prefill_llm, decode_llm = _engine(model_dir), _engine(model_dir)
    prefill_role, decode_role = PrefillRole(prefill_llm), DecodeRole(decode_llm, timeout_s=2.0)
    prefill, decode = AsyncLLMEngine(prefill_llm), AsyncLLMEngine(decode_llm)
    prefill.start()
    decode.start()
    yield prefill, prefill_role, decode, decode_role
    prefill.shutdown()
    decode.shutdown()
    prefill_role.close()
    decode_role.close()


async def _collect(pd: DisaggregatedEngine, prompt=PROMPT, params=PARAMS):
    stream = await pd.add_request("r", prompt, params)
    outs = [out async for out in stream]
    await stream.aclose()
    return outs


def _assert_idle(*llms) -> None:
    for llm in llms:
        manager = llm.kv_cache_manager
        assert not llm.has_unfinished_requests()
        assert manager.num_free_blocks == manager.num_usable_blocks


def test_one_stream_equal_to_one_engine(setup, single):
    prefill, prefill_role, decode, decode_role = setup
    pd = DisaggregatedEngine(
        decode, decode_role, PrefillHandle(prefill, prefill_role), 4, "pagedattn"
    )
    outs = asyncio.run(_collect(pd))
    first, last = outs[0], outs[-1]
    # The prefill's first token comes alone, unfinished; the end reads as one request.
    assert len(first.outputs[0].token_ids) == 1 and not first.finished
    assert first.outputs[0].finish_reason is None
    assert last.finished and last.prompt_token_ids == PROMPT
    assert last.outputs[0].token_ids == single.token_ids
    assert last.outputs[0].text == single.text
    assert last.outputs[0].finish_reason == "length" and last.num_cached_tokens == 0
    assert pd.num_disaggregated == 1 and pd.transfers[-1]["num_blocks"] == 17
    assert len(decode_role.inbox) == 0
    _assert_idle(prefill.engine, decode.engine)


def test_a_failing_prefill_is_retried_then_computed_on_decode(setup, single):
    prefill, prefill_role, decode, decode_role = setup
    once = PrefillHandle(prefill, prefill_role, failures=1)
    pd = DisaggregatedEngine(decode, decode_role, once, 4, "pagedattn")
    assert asyncio.run(_collect(pd))[-1].outputs[0].token_ids == single.token_ids
    assert (pd.num_prefill_retries, pd.num_disaggregated, pd.num_local) == (1, 1, 0)
    always = PrefillHandle(prefill, prefill_role, failures=99)
    pd = DisaggregatedEngine(decode, decode_role, always, 4, "pagedattn")
    assert asyncio.run(_collect(pd))[-1].outputs[0].token_ids == single.token_ids
    assert (pd.num_prefill_retries, pd.num_disaggregated, pd.num_local) == (2, 0, 1)
    _assert_idle(prefill.engine, decode.engine)


def test_short_prompts_and_logprobs_stay_on_the_decode_replica(setup):
    prefill, prefill_role, decode, decode_role = setup
    handle = PrefillHandle(prefill, prefill_role)
    pd = DisaggregatedEngine(decode, decode_role, handle, 4, "pagedattn", min_prompt_tokens=71)
    asyncio.run(_collect(pd))
    asyncio.run(_collect(pd, PROMPT + [9], SamplingParams(max_tokens=3, logprobs=1)))
    assert handle.num_calls == 0 and pd.num_local == 2
    asyncio.run(_collect(pd, PROMPT + [9]))
    assert handle.num_calls == 1 and pd.num_disaggregated == 1
