"""DisaggregatedEngine without Ray: a prefill AsyncLLMEngine behind a stand-in handle, a decode
AsyncLLMEngine that pulls over ZMQ. One stream equal to one engine's (text, stop strings across
the first token, a first token that is half a character, the client's TTFT); failed prefills
retried, then computed on the decode side; a dead prefill's pull fails fast; short prompts
computed there; no leaks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import threading
import time

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from pagedattn import LLM, SamplingParams
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.kv_transfer import pd as pd_module
from pagedattn.kv_transfer.pd import DecodeRole, PrefillRole
from pagedattn.metrics import PREFIX
from pagedattn.serve.pd_engine import DisaggregatedEngine, run_prefill
from tests.model.tiny import SPECIAL_TOKENS, TINY_VOCAB_SIZE, make_tiny_llama

PROMPT = list(range(5, 5 + 70))
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _engine(model_dir):
    return LLM(model_dir, dtype="float32", num_blocks=128, block_size=4).engine


class PrefillHandle:
    """Stands in for the prefill deployment's handle: ``prefill.remote(...)`` is awaitable."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        role: PrefillRole,
        failures: int = 0,
        delay_s: float = 0.0,
        die_after: bool = False,
    ) -> None:
        self.engine, self.role, self.failures, self.num_calls = engine, role, failures, 0
        # die_after: the replica dies (its BlockServer closes) once it has answered.
        self.delay_s, self.die_after = delay_s, die_after
        self.prefill = self

    def remote(self, request_id, prompt, params, cache_salt, priority, routing_hashes=None):
        self.num_calls += 1
        assert len(routing_hashes) == len(prompt) // 4  # the prefix router's input
        if self.num_calls <= self.failures:
            return asyncio.ensure_future(self._die())
        coro = run_prefill(self.engine, self.role, request_id, prompt, params, cache_salt)
        return asyncio.ensure_future(self._answer(coro))

    async def _answer(self, coro):
        await asyncio.sleep(self.delay_s)
        result = await coro
        if self.die_after:
            self.role.server.close()
        return result

    async def _die(self):
        raise RuntimeError("ActorDiedError: the prefill replica died")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def _run(llm, params, prompt=PROMPT):
    """One engine's output for a request (the reference a PD stream must equal)."""
    llm.add_request(f"s{time.monotonic_ns()}", prompt, params)
    while llm.has_unfinished_requests():
        for o in llm.step():
            final = o
    return final.outputs[0]


@pytest.fixture(scope="module")
def reference(model_dir):
    return _engine(model_dir)


@pytest.fixture(scope="module")
def single(reference):
    return _run(reference, PARAMS)


def _make_setup(model_dir):
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


@pytest.fixture
def setup(model_dir):
    yield from _make_setup(model_dir)


async def _collect(pd: DisaggregatedEngine, prompt=PROMPT, params=PARAMS):
    stream = await pd.add_request("r", prompt, params)
    outs = [out async for out in stream]
    await stream.aclose()
    return outs


def _assert_idle(*llms) -> None:
    for llm in llms:
        manager = llm.kv_cache_manager
        deadline = time.monotonic() + 5.0  # NOTE: an abort lands on the loop thread's next turn
        while llm.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not llm.has_unfinished_requests()
        assert manager.num_free_blocks == manager.num_usable_blocks


def _assert_same(outs, expected, params=PARAMS) -> None:
    """The PD stream reads as one engine's: final output and the streamed deltas joined."""
    last = outs[-1].outputs[0]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert last.token_ids == expected.token_ids
    assert (last.finish_reason, last.stop_reason) == (expected.finish_reason, expected.stop_reason)
    assert last.text == expected.text
    # As the server streams (responses.py): text[sent:], less a stop string's length - 1.
    streamed = ""
    for out in outs:
        text, final = out.outputs[0].text, out.finished
        end = len(text) if final else len(text) - params.output_text_buffer_length
        streamed += text[len(streamed) : max(len(streamed), end)]
    assert streamed == expected.text


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


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_the_first_token_ends_it_as_one_engine(
    setup, reference, single, include
):
    prefill, prefill_role, decode, decode_role = setup
    first_text = _run(reference, dataclasses.replace(PARAMS, max_tokens=1)).text
    cut = len(first_text)
    stop = single.text[cut - 1 : cut + 2]  # the first token's last char, then the second's
    params = dataclasses.replace(PARAMS, stop=[stop], include_stop_str_in_output=include)
    expected = _run(reference, params)
    assert (expected.finish_reason, len(expected.token_ids)) == ("stop", 2)
    pd = DisaggregatedEngine(
        decode, decode_role, PrefillHandle(prefill, prefill_role), 4, "pagedattn"
    )
    _assert_same(asyncio.run(_collect(pd, params=params)), expected, params)
    assert pd.num_disaggregated == 1
    _assert_idle(prefill.engine, decode.engine)  # the decode half was aborted at the stop


def _byte_fallback_model(model_dir, tmp_path, first_ids):
    """The tiny model with a byte-fallback tokenizer in which the given ids are the bytes of
    'é' (0xC3 0xA9): the first is half a character alone."""
    out = tmp_path / "bytes"
    shutil.copytree(model_dir, out)
    vocab = {w: i for i, w in enumerate(SPECIAL_TOKENS)}
    for i in range(len(SPECIAL_TOKENS), TINY_VOCAB_SIZE):
        vocab[f"t{i}_"] = i
    vocab = {w: i for w, i in vocab.items() if i not in first_ids}
    vocab.update({"<0xC3>": first_ids[0], "<0xA9>": first_ids[1]})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    (out / "tokenizer.json").unlink()
    fast.save_pretrained(out)
    return out


def test_a_first_token_that_is_half_a_character_keeps_its_text(model_dir, single, tmp_path):
    first_ids = single.token_ids[:2]
    assert first_ids[0] != first_ids[1] and min(first_ids) >= len(SPECIAL_TOKENS)
    path = _byte_fallback_model(model_dir, tmp_path, first_ids)
    expected = _run(_engine(path), PARAMS)
    assert expected.token_ids == single.token_ids  # the weights, not the tokenizer, pick them
    assert expected.text.startswith("é")
    gen = _make_setup(path)
    prefill, prefill_role, decode, decode_role = next(gen)
    try:
        handle = PrefillHandle(prefill, prefill_role)
        pd = DisaggregatedEngine(decode, decode_role, handle, 4, "pagedattn")
        outs = asyncio.run(_collect(pd))
        assert outs[0].outputs[0].text == ""  # NOTE: as one engine: nothing until it completes
        _assert_same(outs, expected)
    finally:
        next(gen, None)


def _sample(decode: AsyncLLMEngine, name: str) -> float:
    return decode.metrics.registry.get_sample_value(
        f"{PREFIX}_{name}", {"model_name": decode.metrics.model_name}
    )


def test_ttft_and_latencies_are_the_clients(setup, single):
    prefill, prefill_role, decode, decode_role = setup
    handle = PrefillHandle(prefill, prefill_role, delay_s=0.3)
    pd = DisaggregatedEngine(decode, decode_role, handle, 4, "pagedattn")
    start = time.monotonic()
    outs = asyncio.run(_collect(pd))
    elapsed = time.monotonic() - start
    metrics = outs[-1].metrics
    assert outs[-1].outputs[0].token_ids == single.token_ids
    assert 0.3 <= metrics.ttft <= outs[0].metrics.ttft + 0.01
    assert metrics.e2e_latency is not None and metrics.ttft < metrics.e2e_latency <= elapsed
    assert metrics.num_generated_tokens == len(single.token_ids)
    # The server's histograms and counters: one request, the client's prompt and tokens.
    assert _sample(decode, "time_to_first_token_seconds_count") == 1
    assert 0.3 <= _sample(decode, "time_to_first_token_seconds_sum") < elapsed
    assert 0.3 <= _sample(decode, "e2e_request_latency_seconds_sum") <= elapsed
    assert _sample(decode, "prompt_tokens_total") == len(PROMPT)
    assert _sample(decode, "generation_tokens_total") == len(single.token_ids)
    assert _sample(decode, "inter_token_latency_seconds_count") == len(single.token_ids) - 1


def test_a_pull_from_a_dead_prefill_replica_recomputes_at_once(setup, single):
    prefill, prefill_role, decode, decode_role = setup
    decode_role.timeout_s = 10.0
    handle = PrefillHandle(prefill, prefill_role, die_after=True)
    pd = DisaggregatedEngine(decode, decode_role, handle, 4, "pagedattn")
    start = time.monotonic()
    assert asyncio.run(_collect(pd))[-1].outputs[0].token_ids == single.token_ids
    assert time.monotonic() - start < 3.0 and pd.transfers[-1]["num_blocks"] == 0
    assert decode_role.is_unreachable(prefill_role.endpoint)
    # The next pull from it is not even tried.
    asyncio.run(_collect(pd, PROMPT[::-1]))
    assert decode_role.num_skipped_pulls == 1 and pd.num_disaggregated == 2
    _assert_idle(prefill.engine, decode.engine)


def test_pulled_blocks_load_in_pieces_between_steps(setup, single, monkeypatch):
    prefill, prefill_role, decode, decode_role = setup
    value_bytes = decode_role._format.value_bytes
    monkeypatch.setattr(pd_module, "PRELOAD_PIECE_BYTES", 5 * value_bytes)
    pieces, loads = [], []
    preload_piece, load_blocks = decode_role.preload_piece, decode_role.connector.load_blocks

    def record_piece(*args):
        pieces.append(preload_piece(*args))
        return pieces[-1]

    def record_load(kv_caches, block_ids, block_hashes):
        loads.append(len(block_ids))
        return load_blocks(kv_caches, block_ids, block_hashes)

    monkeypatch.setattr(decode_role, "preload_piece", record_piece)
    monkeypatch.setattr(decode_role.connector, "load_blocks", record_load)
    pd = DisaggregatedEngine(
        decode, decode_role, PrefillHandle(prefill, prefill_role), 4, "pagedattn"
    )
    assert asyncio.run(_collect(pd))[-1].outputs[0].token_ids == single.token_ids
    # 17 blocks: 3 engine calls of 5 before the request; its own first step loaded the last 2.
    assert pieces == [5, 5, 5] and loads == [5, 5, 5, 2]
    assert decode_role.num_preloaded_blocks == 15 and len(decode_role.inbox) == 0
    _assert_idle(prefill.engine, decode.engine)
    # A second request of the same prompt pulls nothing: the blocks stayed in the prefix cache.
    asyncio.run(_collect(pd))
    assert pd.transfers[-1]["num_local_blocks"] == 17 and pd.transfers[-1]["num_blocks"] == 0


def test_decode_steps_go_on_while_a_pull_is_in_flight(setup, single, monkeypatch):
    prefill, prefill_role, decode, decode_role = setup
    # NOTE: a pull of more than one piece: it runs on the low-priority pull thread
    monkeypatch.setattr(pd_module, "PRELOAD_PIECE_BYTES", 5 * decode_role._format.value_bytes)
    pulling, release = threading.Event(), threading.Event()
    get = prefill_role.outbox.get

    def slow_get(key):
        pulling.set()
        release.wait(10.0)  # NOTE: let go once the other stream has stepped meanwhile
        return get(key)

    prefill_role.outbox.get = slow_get
    pd = DisaggregatedEngine(
        decode, decode_role, PrefillHandle(prefill, prefill_role), 4, "pagedattn"
    )

    async def main():
        other = await decode.add_request(
            "other", [7] * 9, dataclasses.replace(PARAMS, max_tokens=40)
        )
        pd_task = asyncio.ensure_future(_collect(pd))
        num_during_pull = 0
        async for _ in other:
            if pulling.is_set() and not release.is_set():
                num_during_pull += 1
                if num_during_pull == 3:
                    release.set()
        return num_during_pull, await pd_task

    num_during_pull, outs = asyncio.run(main())
    assert num_during_pull >= 3
    # The pull ran on a thread of lower CPU priority than the engine loop's.
    assert decode_role.puller.nice > os.getpriority(os.PRIO_PROCESS, 0)
    assert outs[-1].outputs[0].token_ids == single.token_ids
    _assert_idle(prefill.engine, decode.engine)


def test_a_client_that_leaves_after_the_first_token_leaks_nothing(setup, single):
    prefill, prefill_role, decode, decode_role = setup
    pd = DisaggregatedEngine(
        decode, decode_role, PrefillHandle(prefill, prefill_role), 4, "pagedattn"
    )

    async def leave(wait_s: float):
        stream = await pd.add_request("r", PROMPT, PARAMS)
        first = await stream.__anext__()  # NOTE: the pull and the add start with it
        await asyncio.sleep(wait_s)
        await stream.aclose()
        return first

    for wait_s in (0.0, 0.005, 0.05):  # mid-pull, mid-add, decoding
        first = asyncio.run(leave(wait_s))
        assert first.outputs[0].token_ids == single.token_ids[:1]
        _assert_idle(prefill.engine, decode.engine)
        deadline = time.monotonic() + 5.0  # NOTE: a pull left running is released when it ends
        while len(decode_role.inbox) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(decode_role.inbox) == 0
    # The handoff's timings of a stream read to its end: pulled, then in the engine, then decoded.
    asyncio.run(_collect(pd))
    handoff = pd.transfers[-1]
    assert 0 < handoff["pulled_s"] <= handoff["added_s"] <= handoff["first_decode_s"]
