"""The second KV tier wired into the engine: reuse across restarts and processes, corruption,
a store that is down, tenants kept apart; greedy output always equals a cold run's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedattn import LLM, SamplingParams
from tests.kv_transfer.conftest import start_redis_server
from tests.model.tiny import make_tiny_llama

PROMPT = list(range(5, 5 + 70))  # 70 tokens: 17 full blocks of 4, the last token computed
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def _llm(model_dir, kv_store=None, **kwargs) -> LLM:
    return LLM(
        model_dir, dtype="float32", num_blocks=128, block_size=4, kv_store=kv_store, **kwargs
    )


@pytest.fixture(scope="module")
def cold(model_dir) -> list[int]:
    return _llm(model_dir).generate([PROMPT], PARAMS)[0].outputs[0].token_ids


def _generate(llm, prompt=PROMPT, salt=None) -> list[int]:
    llm.engine.add_request("r", prompt, PARAMS, cache_salt=salt)
    out = None
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            out = o
    return out.outputs[0].token_ids


def test_a_restarted_engine_loads_the_prompt_from_a_file_store(model_dir, tmp_path, cold):
    url = f"file://{tmp_path}/kv"
    first = _llm(model_dir, url)
    assert _generate(first) == cold
    first.engine.close()
    assert first.get_stats().kv_store.num_saved_blocks >= 17
    second = _llm(model_dir, url)  # a fresh engine: an empty block pool, the same store
    assert _generate(second) == cold
    stats = second.get_stats()
    assert stats.kv_store.num_loaded_blocks == 17 and stats.kv_store.num_hit_tokens == 68
    # The store's tokens count as cached; only the last 2 prompt tokens were computed.
    assert stats.prefix_cache_hits == 0 and stats.num_prompt_tokens == 2
    second.engine.close()


def test_corrupted_entries_mean_recompute_not_wrong_output(model_dir, tmp_path, cold):
    url = f"file://{tmp_path}/kv"
    writer = _llm(model_dir, url)
    _generate(writer)
    writer.engine.close()
    files = sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert len(files) >= 17
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF  # a flipped byte
        else:
            data = data[: len(data) // 3]  # a truncated entry
        path.write_bytes(bytes(data))
    reader = _llm(model_dir, url)
    assert _generate(reader) == cold
    assert reader.get_stats().kv_store.num_corrupt_entries >= 1
    reader.engine.close()


def test_tenants_never_load_each_others_blocks(model_dir, tmp_path, cold):
    url = f"file://{tmp_path}/kv"
    a = _llm(model_dir, url)
    assert _generate(a, salt="tenant-a") == cold
    a.engine.close()
    b = _llm(model_dir, url)
    assert _generate(b, salt="tenant-b") == cold
    assert b.get_stats().kv_store.num_loaded_blocks == 0
    assert _generate(b, salt="tenant-a") != [] and b.get_stats().kv_store.num_loaded_blocks > 0
    b.engine.close()


def test_a_store_that_is_down_degrades_to_recompute(model_dir, cold):
    server = start_redis_server()
    url = server.url
    server.stop()  # nothing listens there any more
    llm = _llm(model_dir, url)
    assert _generate(llm) == cold
    assert _generate(llm, PROMPT[:50]) != []
    assert llm.get_stats().kv_store.num_store_errors >= 1
    llm.engine.close()


def test_engine_b_served_from_engine_a_blocks_through_redis(model_dir, cold):
    server = start_redis_server()
    try:
        script = (
            "import sys; sys.path.insert(0, sys.argv[1]);"
            "from pagedattn import LLM, SamplingParams;"
            "llm = LLM(sys.argv[2], dtype='float32', num_blocks=128, block_size=4, "
            "kv_store=sys.argv[3]);"
            f"out = llm.generate([{PROMPT!r}], SamplingParams(temperature=0, max_tokens=8, "
            "ignore_eos=True));"
            "llm.engine.close(); print(out[0].outputs[0].token_ids)"
        )
        root = str(Path(__file__).resolve().parents[2])
        proc = subprocess.run(
            [sys.executable, "-c", script, root, str(model_dir), server.url],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == str(cold)
        b = _llm(model_dir, server.url)
        assert _generate(b) == cold
        assert b.get_stats().kv_store.num_loaded_blocks == 17
        b.engine.close()
    finally:
        server.stop()


def test_store_counters_reach_prometheus(model_dir, tmp_path):
    from pagedattn.metrics import ServerMetrics

    llm = _llm(model_dir, f"file://{tmp_path}/kv")
    _generate(llm)
    llm.engine.close()
    metrics = ServerMetrics("tiny")
    metrics.record_engine_stats(llm.get_stats())
    text = metrics.render()[0].decode()
    written = llm.get_stats().kv_store.bytes_written
    assert written > 0
    assert f'pagedattn_kv_store_bytes_written_total{{model_name="tiny"}} {float(written)}' in text
    assert 'pagedattn_kv_store_miss_tokens_total{model_name="tiny"} 68.0' in text
