"""Tensor parallelism on 2 ranks x 1 thread (gloo): parity with 1 rank, shared blocks, faults."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from pagedattn import LLM, SamplingParams
from pagedattn.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedattn.model.parallel_layers import ShardingError
from tests.model.tiny import make_tiny_gemma3, make_tiny_llama

NUM_NEW = 12
TOP_K = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=TOP_K)


def _prompts(vocab: int = 128) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]


def check_logprobs_close(ref, other) -> None:
    """vLLM's rule: equal greedy tokens, or at the first divergence each side's token is among
    the other side's top-k logprobs."""
    for a, b in zip(ref, other, strict=True):
        ids_a, ids_b = a.outputs[0].token_ids, b.outputs[0].token_ids
        for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)):
            if x != y:
                assert x in b.outputs[0].logprobs[i] and y in a.outputs[0].logprobs[i], (i, x, y)
                break


def _generate(path, tp: int, prompts, params=GREEDY, **kwargs):
    llm = LLM(path, dtype="float32", tensor_parallel_size=tp, num_threads=1, **kwargs)
    try:
        return llm.generate(prompts, params), llm.engine.get_stats()
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tp-llama"))


@pytest.mark.parametrize("model", ["llama", "gemma3-one-kv-head", "qwen3-moe", "mixtral"])
def test_greedy_output_matches_one_rank(model, tiny_llama, tmp_path):
    from tests.model.test_moe_parity import make_tiny_mixtral, make_tiny_qwen3_moe

    if model == "llama":
        path = tiny_llama
    elif model == "qwen3-moe":  # NOTE: each expert's FFN split over the ranks, a dense layer too
        path = make_tiny_qwen3_moe(tmp_path)
    elif model == "mixtral":
        path = make_tiny_mixtral(tmp_path)
    else:  # NOTE: one KV head on 2 ranks: the KV head is replicated on both
        path = make_tiny_gemma3(tmp_path, num_key_value_heads=1)
    prompts = _prompts()
    ref, _ = _generate(path, 1, prompts)
    out, stats = _generate(path, 2, prompts)
    check_logprobs_close(ref, out)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert stats.kv_cache_usage == 0.0


def test_rank_placement_gives_ranks_cores_of_their_own_when_all_fit(monkeypatch):
    from pagedattn.distributed.cpu_bind import AUTO, OFF
    from pagedattn.worker import tp_executor

    monkeypatch.setattr(tp_executor, "numa_nodes", lambda: [[0, 1, 2, 3]])
    monkeypatch.setattr(tp_executor.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    place = tp_executor.rank_placement
    assert [place(r, 2, None, AUTO) for r in (0, 1)] == [([0, 1], 2), ([2, 3], 2)]
    assert [place(r, 4, 1, AUTO) for r in (0, 3)] == [([0], 1), ([3], 1)]
    assert place(1, 2, 3, AUTO) == ([], 3)  # 2 x 3 threads do not fit in 4 CPUs: none bound
    assert place(1, 2, 1, OFF) == ([], 1)
    assert place(1, 2, 1, [[3], [0, 2]]) == ([0, 2], 1)
    # Two NUMA nodes: a node per rank, unless binding is off.
    monkeypatch.setattr(tp_executor, "numa_nodes", lambda: [[0, 1], [2, 3]])
    assert place(1, 2, None, AUTO) == ([2, 3], 2)
    assert place(1, 2, None, OFF) == ([], 2)


def _affinity(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of process ``pid``."""
    tasks = os.listdir(f"/proc/{pid}/task")
    return {frozenset(os.sched_getaffinity(int(t))) for t in tasks}


def test_preemption_forks_and_abort_share_block_ids_on_every_rank(tiny_llama):
    """A pool too small for the batch (preemption, recompute), n=2 siblings sharing prompt
    blocks (copy-on-write on every rank) and an abort mid-run: every rank must read the blocks
    rank 0's manager handed out, so the tokens equal one rank's and every block comes back."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=NUM_NEW, ignore_eos=True)
    results = {}
    before = sorted(os.sched_getaffinity(0))
    for tp in (1, 2):
        llm = LLM(
            tiny_llama,
            dtype="float32",
            tensor_parallel_size=tp,
            num_threads=1,
            num_blocks=14,
            block_size=4,
        )
        engine = llm.engine
        try:
            if tp == 2 and len(before) >= 2:  # PAGEDATTN_CPU_BIND=auto: a core per rank
                (worker,) = engine.runner.worker_pids()
                assert _affinity(os.getpid()) == {frozenset([before[0]])}
                assert _affinity(worker) == {frozenset([before[1]])}
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", p, params)
            engine.add_request("aborted", prompts[3], params)
            finished, steps = {}, 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = [c.token_ids for c in out.outputs]
                steps += 1
                if steps == 3:
                    engine.abort_request("aborted")
            stats = engine.get_stats()
            assert stats.num_preemptions > 0
            assert stats.kv_cache_usage == 0.0
            results[tp] = finished
        finally:
            engine.close()
    assert "aborted" not in results[2]
    assert results[2] == results[1]
    assert _affinity(os.getpid()) == {frozenset(before)}  # close() unbinds the caller


def test_a_killed_worker_ends_requests_with_an_error_within_seconds(tiny_llama):
    """The request in flight gets an error, the loop stops with the fault (what /health reads
    to answer 503), and rank 0 does not wait out the collective timeout."""
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2, num_threads=1, tp_timeout_s=30)
    engine = AsyncLLMEngine(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> float:
        stream = await engine.add_request("a", _prompts()[1], params)
        await anext(stream)
        (pid,) = llm.engine.runner.worker_pids()
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="rank 1"):
            async for _ in stream:
                pass
        return time.monotonic() - t0

    try:
        assert asyncio.run(main()) < 5
        assert engine.fault is not None and not engine.is_running
    finally:
        engine.shutdown()
        llm.engine.close()


def test_a_worker_killed_while_idle_stops_the_loop_without_a_request(tiny_llama):
    """No request in flight: the idle loop's health check sees the dead rank within seconds
    (what /health reads to answer 503), and the next request is refused at once."""
    llm = LLM(tiny_llama, dtype="float32", tensor_parallel_size=2, num_threads=1, tp_timeout_s=30)
    engine = AsyncLLMEngine(llm.engine)
    engine.start()
    try:
        assert engine.is_running
        (pid,) = llm.engine.runner.worker_pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.is_running
        assert "rank 1" in str(engine.fault)

        async def add() -> None:
            await engine.add_request("b", _prompts()[0], SamplingParams(max_tokens=4))

        with pytest.raises(EngineDeadError):
            asyncio.run(add())
    finally:
        engine.shutdown()
        llm.engine.close()


@pytest.mark.parametrize("case", ["q8_0-file", "q8_0-file-tied", "q4_k-at-load", "moe-q8_0-file"])
def test_gguf_blocks_split_over_ranks_match_one_rank(case, tmp_path, capfd):
    """Each rank runs its shard of the blocks as stored (q/k/v and gate/up rows, llama.cpp's
    permuted Q/K rows included; whole blocks of o/down columns; the vocab rows of the embedding
    and LM head, tied or not; each expert's gate/up rows and down columns): greedy output
    equals one rank's."""
    from tests.model.gguf_writer import write_gguf
    from tests.model.test_moe_parity import make_tiny_qwen3_moe

    if case == "q4_k-at-load":  # NOTE: 256-column blocks: each rank's o/down columns hold one
        path, kwargs = (
            make_tiny_llama(
                tmp_path,
                hidden_size=256,
                intermediate_size=512,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=64,
            ),
            {"quantization": "q4_k"},
        )
    elif case == "moe-q8_0-file":  # NOTE: 64 expert FFN columns: one Q8_0 block per rank
        hf_dir = make_tiny_qwen3_moe(tmp_path, moe_intermediate_size=64, mlp_only_layers=[])
        path, kwargs = write_gguf(hf_dir, tmp_path / "moe.gguf", "qwen3moe", q8_0=True), {}
    else:
        hf_dir = make_tiny_llama(tmp_path, tie_word_embeddings=case.endswith("tied"))
        path, kwargs = write_gguf(hf_dir, tmp_path / "tiny.gguf", "llama", q8_0=True), {}
    prompts = _prompts()
    ref, _ = _generate(path, 1, prompts, **kwargs)
    capfd.readouterr()
    out, _ = _generate(path, 2, prompts, **kwargs)
    err = capfd.readouterr().err
    kind = "Q4_K" if case == "q4_k-at-load" else "Q8_0"
    # each rank prints the same lines for the type (interleaved, and as stored where the rows
    # are not 8n or the table is looked up): blocks, not floats
    lines = [line for line in err.splitlines() if line.startswith(f"[weights] {kind} x")]
    assert lines and lines[: len(lines) // 2] == lines[len(lines) // 2 :], err
    assert len(lines) % 2 == 0 and not any("float" in line for line in lines), err
    assert "split over 2 ranks" in err
    check_logprobs_close(ref, out)
    # NOTE: not token-identical: each rank's plan measures its own switch from int8 dot kernels
    # to float tiles on its shard's shapes, so a step can run the other kernel; a mis-cut shard
    # moves the logprobs by whole nats.
    assert max_logprob_gap(ref, out) < 0.05


def max_logprob_gap(ref, other) -> float:
    """The largest difference of a top-k token's logprob on both sides, up to each output's
    first differing token."""
    gap = 0.0
    for a, b in zip(ref, other, strict=True):
        for x, y, la, lb in zip(
            a.outputs[0].token_ids,
            b.outputs[0].token_ids,
            a.outputs[0].logprobs,
            b.outputs[0].logprobs,
            strict=True,
        ):
            gap = max([gap] + [abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()])
            if x != y:
                break
    return gap


def test_shards_that_would_split_a_block_are_refused(tmp_path):
    """4 heads of 64 on 2 ranks: 128 o_proj columns each, half a Q4_K block."""
    path = make_tiny_llama(tmp_path, hidden_size=256, intermediate_size=512, head_dim=64)
    with pytest.raises(ShardingError, match="Q4_K blocks hold 256 columns.*no --quantization"):
        _generate(path, 2, _prompts(), quantization="q4_k")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_packaged_models_match_one_rank(model):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=TOP_K)
    ref, _ = _generate(model, 1, prompts, params)
    out, _ = _generate(model, 2, prompts, params)
    check_logprobs_close(ref, out)


def test_each_rank_saves_and_loads_its_shard_of_the_kv_store(tiny_llama, tmp_path):
    """Blocks written by 2 ranks are loaded back by 2 new ranks (each its own shard, under keys
    that name the rank and the size); a 1-rank engine never loads a shard."""
    url = f"file://{tmp_path}/kv"
    prompt = list(range(5, 5 + 70))  # 17 full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = {"dtype": "float32", "num_threads": 1, "num_blocks": 64, "block_size": 4}
    cold = LLM(tiny_llama, **kwargs).generate([prompt], params)[0].outputs[0].token_ids
    for expect_loaded in (0, 17):
        llm = LLM(tiny_llama, tensor_parallel_size=2, kv_store=url, **kwargs)
        try:
            assert llm.generate([prompt], params)[0].outputs[0].token_ids == cold
            assert llm.engine.get_stats().kv_store.num_loaded_blocks == expect_loaded
        finally:
            llm.engine.close()
    single = LLM(tiny_llama, kv_store=url, **kwargs)
    assert single.generate([prompt], params)[0].outputs[0].token_ids == cold
    assert single.engine.get_stats().kv_store.num_loaded_blocks == 0
    single.engine.close()
