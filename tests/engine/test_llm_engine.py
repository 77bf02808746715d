"""Engine behaviour on a tiny model: sampling, sharing, beam search, aborts and bad input."""

from __future__ import annotations

import pytest

from pagedattn import LLM, BeamSearchParams, SamplingParams
from pagedattn.config import ConfigError
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.model.loader import ModelNotFoundError
from pagedattn.sampling_params import InvalidSamplingParamsError
from tests.model.tiny import make_tiny_llama

PROMPT = [5, 9, 11, 7, 3, 8, 21, 30, 4, 6, 12, 14, 15, 16, 17, 18, 19, 20, 22]  # 19 tokens


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    return LLM(path, dtype="float32", num_blocks=128, block_size=4)


def _assert_all_free(llm):
    stats = llm.get_stats()
    assert stats.kv_cache_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = llm.generate([PROMPT[:7], PROMPT, PROMPT[3:]], [other, params, other])
    assert batch[1].outputs[0].token_ids == alone
    assert len(alone) == 12
    _assert_all_free(llm)


def test_n_sequences_share_prompt_blocks(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine = llm.engine
    engine.add_request("par", PROMPT, params)
    shared_seen = False
    outputs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out
        live = engine.requests.get("par")
        core_ids = [] if live is None else [s.core.request_id for s in live.seqs]
        tables = [
            engine.kv_cache_manager.get_block_ids(core_id)
            for core_id in core_ids[1:]
            if core_id in engine.scheduler.requests
        ]
        if tables and core_ids[0] in engine.scheduler.requests:
            assert core_ids[1:] == [f"{core_ids[0]}#1", f"{core_ids[0]}#2"]
            parent = engine.kv_cache_manager.get_block_ids(core_ids[0])[0]
            # The 19-token prompt fills 4 blocks of 4; the children hold the same block ids.
            for t in tables:
                assert t[0][:4] == parent[:4]
            blocks = engine.kv_cache_manager.block_pool.blocks
            assert all(blocks[b].ref_cnt == 3 for b in parent[:4])
            shared_seen = True
    assert shared_seen
    assert outputs is not None and outputs.finished
    assert len(outputs.outputs) == 3
    assert all(len(c.token_ids) == 6 for c in outputs.outputs)
    # Different generators per sequence: the three samples are not all the same.
    assert len({tuple(c.token_ids) for c in outputs.outputs}) > 1
    _assert_all_free(llm)


def test_beam_search_uses_copy_on_write(llm):
    out = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
    seqs = out[0].sequences
    assert len(seqs) == 3
    assert all(len(s.token_ids) == 5 for s in seqs)
    scores = [s.score for s in seqs]
    assert scores == sorted(scores, reverse=True)
    # The best beam of width 1 is greedy decoding.
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    best1 = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True))
    assert best1[0].sequences[0].token_ids == greedy[0].outputs[0].token_ids
    assert llm.engine.kv_cache_manager.stats.num_cow_copies > 0
    _assert_all_free(llm)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert llm.get_stats().kv_cache_usage > 0
    engine.abort_request("a")
    assert llm.get_stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()
    engine.abort_request("unknown-id")  # a no-op


def test_stop_token_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = llm.generate([PROMPT], greedy)[0].outputs[0]
    assert ref.finish_reason == "length"
    stop_at = ref.token_ids[2]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_at])
    out = llm.generate([PROMPT], params)[0].outputs[0]
    first = ref.token_ids.index(stop_at)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


@pytest.mark.parametrize(
    "prompt, kwargs, error",
    [
        ("", {}, InvalidRequestError),
        ([], {}, InvalidRequestError),
        (list(range(3, 3000)), {}, InvalidRequestError),
        ([5, 6], {"max_tokens": -1}, InvalidSamplingParamsError),
        ([5, 6], {"top_p": 0.0}, InvalidSamplingParamsError),
        ([5, 6], {"top_p": 1.5}, InvalidSamplingParamsError),
        ([5, 6], {"max_tokens": 10**6}, InvalidRequestError),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(llm, prompt, kwargs, error):
    with pytest.raises(error) as exc:
        llm.generate([prompt], SamplingParams(**kwargs))
    assert str(exc.value)
    ok = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3))[0]
    assert ok.finished and len(ok.outputs[0].token_ids) >= 1
    _assert_all_free(llm)


def test_unknown_model_path():
    with pytest.raises(ModelNotFoundError, match="no/such/model"):
        LLM("no/such/model")


def test_kv_capacity_from_a_byte_budget_and_a_fraction(tmp_path, monkeypatch):
    from pagedattn.attention.layout import bytes_per_block
    from pagedattn.worker import kv_cache_sizing

    path = make_tiny_llama(tmp_path)
    llm = LLM(path, dtype="float32", kv_cache_memory="1MiB", block_size=16)
    model = llm.engine.model
    per_block = bytes_per_block(
        model.num_layers, 16, model.num_kv_heads, model.head_size, model.dtype
    )
    assert per_block == 2 * model.num_layers * 16 * model.num_kv_heads * model.head_size * 4
    assert llm.engine.kv_cache_manager.num_blocks == 2**20 // per_block
    assert f"{2**20 // per_block} blocks x 16 tokens" in llm.engine.kv_summary
    # Free memory pinned at 16 GiB: the fractions give ~16 KiB and ~32 KiB, a handful of 4 KiB
    # blocks, far below the cap; the real free memory varies from run to run.
    monkeypatch.setattr(kv_cache_sizing, "free_memory_bytes", lambda device: 16 * 2**30)
    small = LLM(path, dtype="float32", kv_cache_memory_fraction=1e-6)
    big = LLM(path, dtype="float32", kv_cache_memory_fraction=2e-6)
    assert small.engine.kv_cache_manager.num_blocks < big.engine.kv_cache_manager.num_blocks
    assert big.engine.kv_cache_manager.num_blocks == int(16 * 2**30 * 2e-6) // per_block


def test_bf16_kv_cache_beside_a_float32_model(tmp_path):
    import torch

    path = make_tiny_llama(tmp_path)
    fp32 = LLM(path, dtype="float32", kv_cache_memory="1MiB", block_size=16)
    bf16 = LLM(
        path, dtype="float32", kv_cache_memory="1MiB", block_size=16, kv_cache_dtype="bfloat16"
    )
    assert all(k.dtype == torch.bfloat16 for k, _ in bf16.engine.runner.kv_caches)
    # The same bytes hold twice the blocks.
    assert bf16.engine.kv_cache_manager.num_blocks == 2 * fp32.engine.kv_cache_manager.num_blocks
    assert "KV cache bfloat16" in bf16.engine.kv_summary
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    # Decode (the compiled kernel), then a prompt that extends a cached prefix (the prefill path).
    for prompt in (PROMPT, PROMPT + [23, 24, 25]):
        ref = fp32.generate([prompt], params)[0].outputs[0]
        got = bf16.generate([prompt], params)[0].outputs[0]
        assert len(got.token_ids) == 8
        # bf16 K/V shift the logits slightly: the first token, whose logits see the fewest
        # rounded values, agrees, and every chosen token's logprob stays close.
        assert got.token_ids[0] == ref.token_ids[0]
        first_ref = ref.logprobs[0][ref.token_ids[0]].logprob
        assert abs(got.logprobs[0][got.token_ids[0]].logprob - first_ref) < 0.05
    _assert_all_free(bf16)
    with pytest.raises(ConfigError, match="only the cpu attention backend"):
        LLM(path, dtype="float32", kv_cache_dtype="bfloat16", attn_backend="torch")


def test_best_of_returns_the_most_likely_candidates(llm):
    sampled = dict(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    all_three = llm.generate([PROMPT], SamplingParams(n=3, logprobs=0, **sampled))[0].outputs
    best = llm.generate([PROMPT], SamplingParams(n=1, best_of=3, **sampled))[0].outputs
    assert len(best) == 1 and best[0].index == 0 and best[0].logprobs is None
    top = max(all_three, key=lambda c: c.cumulative_logprob)
    assert best[0].token_ids == top.token_ids
    assert best[0].cumulative_logprob == pytest.approx(top.cumulative_logprob)
    two = llm.generate([PROMPT], SamplingParams(n=2, best_of=3, **sampled))[0].outputs
    ranked = sorted(all_three, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in two] == [c.token_ids for c in ranked]
    _assert_all_free(llm)


def test_prompt_logprobs_score_every_prompt_token(llm):
    greedy = SamplingParams(temperature=0, max_tokens=1, logprobs=0)
    first = llm.generate([PROMPT], greedy)[0]
    token = first.outputs[0].token_ids[0]
    sampled_lp = first.outputs[0].logprobs[0][token].logprob
    # The prompt extended by that token: its last prompt logprob is the one the sampler saw,
    # though that prefix is in the prefix cache (a request with prompt logprobs skips it).
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    out = llm.generate([PROMPT + [token]], params)[0]
    entries = out.prompt_logprobs
    assert len(entries) == len(PROMPT) + 1 and entries[0] is None
    assert all(PROMPT[p] in entries[p] for p in range(1, len(PROMPT)))
    assert all(len(e) in (2, 3) for e in entries[1:])
    assert entries[-1][token].logprob == pytest.approx(sampled_lp, abs=1e-4)
    assert entries[-1][token].rank == 1  # greedy picked it
    _assert_all_free(llm)


def test_linear_kernel_and_quantization_options_reach_the_model(tmp_path):
    import torch

    from pagedattn.cpu.linear import candidates

    path = make_tiny_llama(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # NOTE: the first kernel this machine offers (panels, amx, mkl, onednn or torch).
    fastest = candidates(torch.float32)[0]
    ref = LLM(path, dtype="float32", num_blocks=32, block_size=4, linear_kernel=fastest)
    forced = LLM(path, dtype="float32", num_blocks=32, block_size=4, linear_kernel="torch")
    assert forced.engine.runner.plan.linear_decode == "torch"
    assert ref.engine.runner.plan.linear_decode == fastest
    down = ref.engine.model.model.layers[0].mlp.down_proj
    assert fastest == "torch" or down.decode.name == fastest
    expected = ref.generate([PROMPT], params)[0].outputs[0].token_ids
    assert forced.generate([PROMPT], params)[0].outputs[0].token_ids == expected
    quant = LLM(path, dtype="float32", num_blocks=32, block_size=4, quantization="int8")
    assert quant.engine.runner.plan.linear_decode.startswith("int8")
    assert quant.engine.model.model.layers[0].mlp.down_proj.decode.name.startswith("int8")
    assert len(quant.generate([PROMPT], params)[0].outputs[0].token_ids) == 6
