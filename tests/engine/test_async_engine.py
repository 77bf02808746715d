"""AsyncLLMEngine on a tiny model: continuous batching, aborts on cancel, errors, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedattn.engine.errors import InvalidRequestError
from tests.model.tiny import make_tiny_llama

PROMPT = [5, 9, 11, 7, 3, 8, 21, 30, 4, 6, 12, 14, 15, 16, 17, 18, 19, 20, 22]


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    return LLM(str(path), dtype="float32", num_blocks=64, block_size=4)


@pytest.fixture
def engine(llm):
    engine = AsyncLLMEngine(llm.engine)
    yield engine
    engine.shutdown()


def test_late_request_joins_the_running_batch(engine):
    async def main():
        long = await engine.add_request("long", PROMPT, _params(60))
        first = await anext(long)
        assert not first.finished
        late = [o async for o in engine.generate(PROMPT[:5], _params(3), "late")]
        rest = [o async for o in long]
        return late[-1], rest[-1]

    late, long = asyncio.run(main())
    assert late.finished and long.finished
    assert len(long.outputs[0].token_ids) == 60
    # Served one at a time, the late request would start after the long one ended.
    assert late.metrics.finished_time < long.metrics.finished_time


def test_leaving_a_stream_aborts_and_frees_blocks(engine, llm):
    async def main():
        async def consume() -> None:
            async for _ in engine.generate(PROMPT, _params(200), "gone"):
                pass

        task = asyncio.create_task(consume())
        while (await engine.get_stats()).kv_cache_usage == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The abort is applied before the next step: one round trip through the loop suffices.
        return await engine.get_stats(), await engine.call(lambda e: e.has_unfinished_requests())

    stats, unfinished = asyncio.run(main())
    assert stats.kv_cache_usage == 0.0
    assert not unfinished


def test_rejected_request_raises_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(InvalidRequestError):
            await engine.add_request("huge", PROMPT, _params(10_000))
        outs = [o async for o in engine.generate(PROMPT, _params(2), "ok")]
        return outs[-1]

    final = asyncio.run(main())
    assert final.finished and len(final.outputs[0].token_ids) == 2


def test_shutdown_fails_streams_in_flight(engine):
    async def main():
        stream = await engine.add_request("cut", PROMPT, _params(200))
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("after", PROMPT, _params(2))

    asyncio.run(main())
    assert not engine.is_running
