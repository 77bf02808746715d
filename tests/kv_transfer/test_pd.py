"""Prefill/decode disaggregation between two engines: the decode engine loads the prefill's
blocks over the direct (ZMQ) transfer and continues the stream token for token; a failed, late
or corrupt transfer means recompute with the same output; no blocks leak on either side."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from pagedattn import LLM, SamplingParams
from pagedattn.kv_transfer.direct import BlockServer
from pagedattn.kv_transfer.memory_store import MemoryKVStore
from pagedattn.kv_transfer.pd import (
    DecodeRole,
    PrefillRole,
    decode_params,
    decode_prompt,
    needs_decode,
    prefill_params,
)
from tests.model.tiny import make_tiny_llama

PROMPT = list(range(5, 5 + 70))  # 70 tokens: 17 full blocks of 4
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def _engine(model_dir, **kwargs):
    return LLM(model_dir, dtype="float32", num_blocks=128, block_size=4, **kwargs).engine


def _run(engine, request_id, prompt, params, salt=None):
    engine.add_request(request_id, prompt, params, cache_salt=salt)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out is not None and out.finished and out.error is None
    return out


def pd_generate(prefill, decode, request_id, prompt=PROMPT, params=PARAMS, salt=None):
    """The two halves of one request: (all token ids, the transfer's result or None)."""
    out = _run(prefill.engine, f"{request_id}-p", prompt, prefill_params(params), salt)
    first = out.outputs[0].token_ids
    if not needs_decode(params, out.outputs[0].finish_reason):
        return first, None
    tp = prefill.transfer_params(out.prompt_token_ids, first[0], salt)
    result = decode.pull(tp)
    rest = _run(decode.engine, f"{request_id}-d", decode_prompt(tp), decode_params(params), salt)
    decode.release(tp)
    return first + rest.outputs[0].token_ids, result


def _assert_no_leaks(*engines) -> None:
    for engine in engines:
        manager = engine.kv_cache_manager
        assert not engine.has_unfinished_requests()
        assert manager.num_free_blocks == manager.num_usable_blocks
        snapshot = engine.kv_snapshot()  # what /debug/kv shows
        assert snapshot["stats"]["num_used_blocks"] == 0 and not snapshot["block_tables"]


@pytest.fixture(scope="module")
def single(model_dir) -> list[int]:
    return _run(_engine(model_dir), "s", PROMPT, PARAMS).outputs[0].token_ids


@pytest.fixture
def pair(model_dir):
    prefill = PrefillRole(_engine(model_dir))
    decode = DecodeRole(_engine(model_dir), timeout_s=2.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def test_decode_engine_loads_the_prompt_and_continues_token_for_token(pair, single):
    prefill, decode = pair
    tokens, result = pd_generate(prefill, decode, "a")
    assert tokens == single
    assert (result.num_local_blocks, result.num_blocks) == (0, 17)
    assert (
        result.num_bytes
        == 17 * decode.connector.block_format(decode.engine.runner.kv_caches).value_bytes
    )
    stats = decode.engine.get_stats()
    assert stats.kv_store.num_loaded_blocks == 17 and stats.kv_store.num_corrupt_entries == 0
    # Only the prompt's last 2 tokens and the first token were computed on the decode side.
    assert stats.num_prompt_tokens == 3
    assert len(decode.inbox) == 0
    _assert_no_leaks(prefill.engine, decode.engine)
    # Again: the decode engine's prefix cache holds the prompt now, so nothing is pulled.
    tokens, result = pd_generate(prefill, decode, "b")
    assert tokens == single and (result.num_local_blocks, result.num_blocks) == (17, 0)
    _assert_no_leaks(prefill.engine, decode.engine)


def test_a_dead_prefill_server_means_recompute(pair, single):
    prefill, decode = pair
    prefill.server.close()
    decode.timeout_s = 0.5
    tokens, result = pd_generate(prefill, decode, "a")
    assert tokens == single and result.num_blocks == 0
    assert decode.engine.get_stats().num_prompt_tokens == len(PROMPT) + 1
    _assert_no_leaks(prefill.engine, decode.engine)


def test_a_server_that_never_answers_times_out(pair, single):
    prefill, decode = pair
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # NOTE: accepts, never reads or answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        prefill.endpoint = silent.getsockopt_string(zmq.LAST_ENDPOINT)
        decode.timeout_s = 0.3
        tokens, result = pd_generate(prefill, decode, "a")
    finally:
        silent.close()
    assert tokens == single and result.num_blocks == 0 and result.seconds >= 0.3
    assert not decode.is_unreachable(prefill.endpoint)  # slow is not dead: the next pull tries


def test_a_closed_server_fails_at_once_and_is_not_asked_again(pair, single):
    prefill, decode = pair
    gone = BlockServer(MemoryKVStore())
    gone.close()  # NOTE: its port refuses connections, as a dead prefill replica's does
    prefill.endpoint = gone.endpoint
    decode.timeout_s = 10.0
    tokens, result = pd_generate(prefill, decode, "a")
    assert tokens == single and result.num_blocks == 0 and result.seconds < 2.0
    assert decode.is_unreachable(gone.endpoint)
    # Another prompt (this one's blocks are now cached here): its pull is not even tried.
    _, result = pd_generate(prefill, decode, "b", prompt=PROMPT[::-1])
    assert result.seconds == 0.0 and decode.num_skipped_pulls == 1


def test_corrupt_blocks_fail_the_checksum_and_are_recomputed(pair, single):
    prefill, decode = pair
    out = _run(prefill.engine, "p", PROMPT, prefill_params(PARAMS))
    tp = prefill.transfer_params(out.prompt_token_ids, out.outputs[0].token_ids[0], None)
    for i in (5, 9):  # flip a byte in two outbox values
        value = bytearray(prefill.outbox.get(tp.block_keys[i]))
        value[len(value) // 2] ^= 0xFF
        prefill.outbox.put(tp.block_keys[i], bytes(value))
    # The pull verifies each value and stops at the first bad one (blocks load contiguously).
    assert decode.pull(tp).num_blocks == 5 and decode.num_corrupt == 1
    rest = _run(decode.engine, "d", decode_prompt(tp), decode_params(PARAMS))
    decode.release(tp)
    assert out.outputs[0].token_ids + rest.outputs[0].token_ids == single
    stats = decode.engine.get_stats().kv_store
    assert stats.num_loaded_blocks == 5 and stats.num_hit_tokens == 5 * 4
    assert len(decode.inbox) == 0
    _assert_no_leaks(prefill.engine, decode.engine)


def test_blocks_of_another_tenant_never_load(pair, single):
    prefill, decode = pair
    out = _run(prefill.engine, "p", PROMPT, prefill_params(PARAMS), "tenant-a")
    tp = prefill.transfer_params(out.prompt_token_ids, out.outputs[0].token_ids[0], "tenant-a")
    assert decode.pull(tp).num_blocks == 17
    rest = _run(decode.engine, "d", decode_prompt(tp), decode_params(PARAMS), "tenant-b")
    decode.release(tp)
    assert out.outputs[0].token_ids + rest.outputs[0].token_ids == single
    assert decode.engine.get_stats().kv_store.num_loaded_blocks == 0
    assert len(decode.inbox) == 0


def test_a_first_token_that_ends_the_request_skips_decode(pair):
    prefill, decode = pair
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    tokens, result = pd_generate(prefill, decode, "a", params=one)
    assert len(tokens) == 1 and result is None
    assert decode.engine.get_stats().num_prompt_tokens == 0


def test_the_shared_store_is_the_fallback_when_the_pull_fails(model_dir, single, tmp_path):
    from pagedattn.kv_transfer.file_store import FileKVStore

    writer = _engine(model_dir, kv_store=f"file://{tmp_path}/kv")
    _run(writer, "w", PROMPT, PARAMS)
    writer.close()
    prefill = PrefillRole(_engine(model_dir))
    decode = DecodeRole(_engine(model_dir), fallback=FileKVStore(tmp_path / "kv"), timeout_s=0.5)
    prefill.server.close()  # the direct pull fails; the file store has the blocks
    tokens, result = pd_generate(prefill, decode, "a")
    assert tokens == single and result.num_blocks == 0
    assert decode.engine.get_stats().kv_store.num_loaded_blocks == 17
    decode.close()


def test_default_model_continues_token_for_token():
    # NOTE: dequantised: the decode side computes the prompt's last token apart from the rest,
    # and int8 activations (the blocks as stored) can turn that float rounding into a flipped
    # close greedy token, as a prefix-cached rerun can (docs/memory.md, "Does a cached rerun
    # answer the same?"). Float32 weights keep it to rounding.
    def engine():
        return LLM(dtype="float32", num_blocks=64, block_size=16, weights="dequantize").engine

    single = engine()
    text = single.apply_chat_template(
        [{"role": "user", "content": "Write one sentence about memory pages in an OS."}]
    )
    prompt = single.tokenize(text)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _run(single, "s", prompt, params).outputs[0].token_ids
    prefill, decode = PrefillRole(engine()), DecodeRole(engine())
    tokens, result = pd_generate(prefill, decode, "a", prompt, params)
    assert tokens == expected
    assert result.num_blocks == len(prompt) // 16 > 0
    _assert_no_leaks(prefill.engine, decode.engine)
    prefill.close()
    decode.close()


def test_inbox_values_that_are_not_whole_blocks_never_load(pair, single):
    prefill, decode = pair
    out = _run(prefill.engine, "p", PROMPT, prefill_params(PARAMS))
    tp = prefill.transfer_params(out.prompt_token_ids, out.outputs[0].token_ids[0], None)
    good = prefill.outbox.get(tp.block_keys[0])
    decode.inbox.put(tp.block_keys[0], b"\0" * len(good))  # right length, wrong header
    for key in tp.block_keys[1:]:
        decode.inbox.put(key, good[:100])  # truncated
    rest = _run(decode.engine, "d", decode_prompt(tp), decode_params(PARAMS))
    decode.release(tp)
    assert out.outputs[0].token_ids + rest.outputs[0].token_ids == single
    assert decode.engine.get_stats().kv_store.num_loaded_blocks == 0
    _assert_no_leaks(prefill.engine, decode.engine)
