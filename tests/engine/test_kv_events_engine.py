"""--kv-events-endpoint: the engine publishes one batch of KV cache events per step over ZMQ,
and an index fed only by them equals the engine's cached blocks (after evictions and a reset)."""

from __future__ import annotations

import time

from pagedattn import LLM, SamplingParams
from pagedattn.distributed.kv_events import AllBlocksCleared, ZmqEventSubscriber
from tests.kv_transfer.conftest import free_port
from tests.model.tiny import make_tiny_llama


def _drain(sub: ZmqEventSubscriber, batches: list, quiet_s: float = 0.3) -> None:
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        got = sub.poll(timeout_ms=50)
        if got:
            batches += got
            deadline = time.monotonic() + quiet_s


def _clears(batch) -> bool:
    return any(isinstance(event, AllBlocksCleared) for event in batch.events)


def _replay(batches: list) -> set[bytes]:
    cached: set[bytes] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                cached.clear()
            elif hasattr(event, "token_ids"):
                cached |= {bytes(h) if not isinstance(h, int) else h for h in event.block_hashes}
            else:
                cached -= {bytes(h) if not isinstance(h, int) else h for h in event.block_hashes}
    return cached


def test_events_replay_to_the_engines_cached_blocks(tmp_path):
    port = free_port()
    llm = LLM(
        make_tiny_llama(tmp_path),
        dtype="float32",
        num_blocks=24,
        block_size=4,
        kv_events_endpoint=f"tcp://*:{port}",  # a wildcard binds (vLLM's convention)
    )
    sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", topic="kv-events")
    batches: list = []
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    # NOTE: ZMQ drops what is published before the subscription reaches the publisher: send
    # prompts until events arrive (bounded), then clear the cache so that the replay starts
    # from an AllBlocksCleared that this subscriber is sure to see.
    for attempt in range(50):
        llm.generate([[60 + attempt] * 9], SamplingParams(temperature=0, max_tokens=1))
        _drain(sub, batches, quiet_s=0.2)
        if batches:
            break
    assert batches, "no KV event reached the subscriber"
    assert engine.reset_prefix_cache()
    _drain(sub, batches)
    batches = batches[next(i for i, b in enumerate(batches) if _clears(b)) :]
    num_steps_before = engine.step_times.num_steps
    # Enough different prompts to fill the 24-block pool: older cached blocks get evicted.
    for i in range(6):
        llm.generate([[7 + i, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]], params)
    _drain(sub, batches)
    num_steps = engine.step_times.num_steps - num_steps_before
    assert 0 < len(batches) - 1 <= num_steps  # at most one batch per step (after the clear)
    seqs = [b.ts for b in batches]
    assert seqs == sorted(seqs)
    pool = engine.kv_cache_manager.block_pool
    actual = {key[:-4] for key in pool.cached_block_hash_to_block}
    assert engine.kv_cache_manager.make_stats(reset=False).num_evictions > 0
    assert _replay(batches) == actual and actual
    assert engine.reset_prefix_cache()
    _drain(sub, batches)
    assert _replay(batches) == set() and not pool.cached_block_hash_to_block
    sub.close()
    engine.close()
