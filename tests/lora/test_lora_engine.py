"""LoRA through the engine: parity with HF + PEFT for mixed batches, slots, preemption, forks,
the prefix cache keyed by adapter, unloading, and the errors a user sees."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedattn import LLM, InvalidRequestError, LoRARequest, SamplingParams
from pagedattn.lora.request import (
    LoRAExistsError,
    LoRAInUseError,
    LoRANotFoundError,
    LoRAPathError,
    LoRARankError,
)
from tests.lora.adapters import hf_peft_greedy, make_peft_adapter
from tests.model.tiny import make_tiny_llama

NUM_NEW = 8
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
PROMPTS = [list(range(5, 16)), list(range(20, 26)), list(range(40, 53))]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(root / "base")
    return {
        "base": base,
        "a8": make_peft_adapter(base, root / "a8", rank=8, seed=1),
        "a16": make_peft_adapter(base, root / "a16", rank=16, seed=2),
        "qv": make_peft_adapter(base, root / "qv", rank=4, seed=3, targets=["q_proj", "v_proj"]),
        "r32": make_peft_adapter(base, root / "r32", rank=32, seed=4),
    }


@pytest.fixture(scope="module")
def hf(files) -> dict[tuple[str | None, int], list[int]]:
    """HF + PEFT greedy tokens per (adapter, prompt index)."""
    return {
        (name, i): hf_peft_greedy(files["base"], None if name is None else files[name], p, NUM_NEW)
        for name in (None, "a8", "a16", "qv")
        for i, p in enumerate(PROMPTS)
    }


def lora(files, name: str, int_id: int | None = None) -> LoRARequest:
    ids = {"a8": 1, "a16": 2, "qv": 3, "r32": 4}
    return LoRARequest(name, int_id or ids[name], str(files[name]))


def make_llm(files, **kwargs) -> LLM:
    options = dict(dtype="float32", num_blocks=128, block_size=4, enable_lora=True, max_loras=2)
    return LLM(files["base"], **(options | kwargs))


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_two_adapters_and_the_base_in_one_batch_match_hf_peft(files, hf):
    # NOTE: small steps: prompts are prefilled in chunks beside other rows' decodes.
    llm = make_llm(files, max_num_batched_tokens=8)
    names = [None, "a8", "a16", "a16", None, "a8"]
    indices = [0, 1, 2, 0, 1, 2]
    reqs = [None if n is None else lora(files, n) for n in names]
    outs = llm.generate([PROMPTS[i] for i in indices], PARAMS, lora_request=reqs)
    expected = [hf[(n, i)] for n, i in zip(names, indices, strict=True)]
    assert tokens(outs) == expected
    # Guard: each adapter changes the output of every prompt.
    for i in range(3):
        assert len({tuple(hf[(n, i)]) for n in (None, "a8", "a16")}) == 3


def test_an_adapter_of_some_projections_only_matches_hf_peft(files, hf):
    llm = make_llm(files)
    outs = llm.generate(PROMPTS, PARAMS, lora_request=lora(files, "qv"))
    assert tokens(outs) == [hf[("qv", i)] for i in range(3)]


def test_more_adapters_than_slots_wait_and_evict_lru(files, hf):
    llm = make_llm(files, max_loras=1)
    names = ["a8", "a16", "qv", None, "a8"]
    reqs = [None if n is None else lora(files, n) for n in names]
    outs = llm.generate([PROMPTS[0]] * len(names), PARAMS, lora_request=reqs)
    assert tokens(outs) == [hf[(n, 0)] for n in names]
    manager = llm.engine.runner.lora_manager
    assert manager.num_slot_loads >= 3 and len(manager.slots) == 1


def test_preemption_under_adapters_resumes_with_the_same_adapter(files, hf):
    # 10 blocks of 4 tokens (one is the null block) cannot hold three sequences of 14-21 tokens
    # (4 + 5 + 6 blocks) at once: some are preempted and computed again.
    llm = make_llm(files, num_blocks=10, max_num_batched_tokens=16)
    names = ["a8", "a16", None]
    reqs = [lora(files, "a8"), lora(files, "a16"), None]
    outs = llm.generate(PROMPTS, PARAMS, lora_request=reqs)
    assert llm.get_stats().num_preemptions > 0
    assert tokens(outs) == [hf[(n, i)] for i, n in enumerate(names)]


def test_forks_run_under_their_parents_adapter(files, hf):
    llm = make_llm(files)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, n=3)
    out = llm.generate([PROMPTS[1]], params, lora_request=lora(files, "a16"))[0]
    assert [c.token_ids for c in out.outputs] == [hf[("a16", 1)]] * 3


def test_prefix_cache_is_shared_under_one_adapter_only(files):
    llm = make_llm(files)
    prompt = list(range(30, 30 + 17))  # 4 full blocks of 4

    def hits(req) -> int:
        before = llm.get_stats().prefix_cache_hits
        llm.generate([prompt], PARAMS, lora_request=req)
        return llm.get_stats().prefix_cache_hits - before

    assert hits(lora(files, "a8")) == 0
    assert hits(lora(files, "a16")) == 0  # the same tokens under another adapter: no block
    assert hits(None) == 0
    assert hits(lora(files, "a8")) == 16
    assert hits(lora(files, "a16")) == 16
    # Unloading an adapter drops its cached blocks: loaded again, it hits nothing.
    pool = llm.engine.kv_cache_manager.block_pool
    before = len(pool.cached_block_hash_to_block)
    llm.remove_lora("a8")
    assert len(pool.cached_block_hash_to_block) < before
    assert hits(lora(files, "a8")) == 0
    assert hits(None) == 16


def test_kv_events_name_the_adapter(files):
    llm = make_llm(files)
    llm.engine.enable_kv_cache_events()
    llm.generate([PROMPTS[0]], PARAMS, lora_request=lora(files, "a8"))
    stored = [e for e in llm.engine.take_kv_events() if type(e).__name__ == "BlockStored"]
    assert stored and all(e.lora_name.startswith("a8#") for e in stored)
    llm.remove_lora("a8")
    removed = [e for e in llm.engine.take_kv_events() if type(e).__name__ == "BlockRemoved"]
    removed_hashes = {h for e in removed for h in e.block_hashes}
    assert {h for e in stored for h in e.block_hashes} <= removed_hashes


def test_adapter_errors_say_what_to_fix(files, tmp_path):
    llm = make_llm(files)
    with pytest.raises(LoRARankError, match="max-lora-rank 32"):
        llm.add_lora(lora(files, "r32"))
    with pytest.raises(LoRAPathError, match="not a folder"):
        llm.add_lora(LoRARequest("nope", 9, str(tmp_path / "missing")))
    with pytest.raises(InvalidRequestError, match="no adapter_config.json"):
        llm.generate([PROMPTS[0]], PARAMS, lora_request=LoRARequest("x", 9, str(tmp_path)))
    llm.add_lora(lora(files, "a8"))
    with pytest.raises(LoRAExistsError):
        llm.add_lora(lora(files, "a8"))
    with pytest.raises(LoRAExistsError, match="id 1"):
        llm.add_lora(LoRARequest("other", 1, str(files["a16"])))
    with pytest.raises(LoRANotFoundError):
        llm.remove_lora("a16")
    llm.engine.add_request("live", PROMPTS[0], PARAMS, lora_request=lora(files, "a8"))
    with pytest.raises(LoRAInUseError):
        llm.remove_lora("a8")
    llm.engine.abort_request("live")
    llm.remove_lora("a8")
    assert llm.list_loras() == []
    plain = LLM(files["base"], dtype="float32", num_blocks=64, block_size=4)
    with pytest.raises(InvalidRequestError, match="enable-lora"):
        plain.generate([PROMPTS[0]], PARAMS, lora_request=lora(files, "a8"))


def test_kv_store_keys_carry_the_adapter(files, tmp_path):
    url = f"file://{tmp_path}/kv"
    prompt = list(range(30, 30 + 21))  # 5 full blocks of 4
    first = make_llm(files, kv_store=url)
    first.generate([prompt], PARAMS, lora_request=lora(files, "a8"))
    first.engine.close()

    def store_hits(req) -> int:
        llm = make_llm(files, kv_store=url)  # a fresh pool: only the store can hit
        llm.generate([prompt], PARAMS, lora_request=req)
        llm.engine.close()
        return llm.get_stats().kv_store.num_hit_tokens

    assert store_hits(lora(files, "a16")) == 0
    assert store_hits(None) == 0
    assert store_hits(lora(files, "a8")) == 20


def test_speculative_decoding_under_adapters_matches_hf_peft(files):
    """Ngram drafts verified on the verify stack with adapter rows beside a base row: the
    greedy tokens stay HF + PEFT's, and drafts were proposed and accepted."""
    prompts = [[5, 6, 7, 8, 9, 10] * 3 + [5, 6], [40, 41, 42, 43] * 4 + [40], [3, 90, 3, 90, 3]]
    names = ["a8", None, "a16"]
    llm = make_llm(
        files,
        speculative_method="ngram",
        num_speculative_tokens=3,
        ngram_min=1,
        ngram_max=3,
        speculative_disable_by_batch_size=64,
    )
    reqs = [None if n is None else lora(files, n) for n in names]
    outs = llm.generate(prompts, PARAMS, lora_request=reqs)
    expected = [
        hf_peft_greedy(files["base"], None if n is None else files[n], p, NUM_NEW)
        for n, p in zip(names, prompts, strict=True)
    ]
    assert tokens(outs) == expected
    stats = llm.get_stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_other_weights_under_a_replaced_name_never_meet_its_blocks(files, hf, tmp_path):
    """Issue 52: unload `a`, load other weights as `a`: no pool or store block of the old `a`
    is used (the adapter's content is in the block hash), and the answer is the new weights'."""
    url = f"file://{tmp_path}/kv"
    prompt = PROMPTS[2]  # 13 tokens: 3 full blocks of 4
    llm = make_llm(files, kv_store=url)
    llm.generate([prompt], PARAMS, lora_request=LoRARequest("a", 1, str(files["a8"])))
    llm.remove_lora("a")
    stats = llm.get_stats()
    pool_before, store_before = stats.prefix_cache_hits, stats.kv_store.num_hit_tokens
    out = llm.generate([prompt], PARAMS, lora_request=LoRARequest("a", 1, str(files["a16"])))
    stats = llm.get_stats()
    assert stats.prefix_cache_hits == pool_before
    assert stats.kv_store.num_hit_tokens == store_before
    assert tokens(out) == [hf[("a16", 2)]]
    llm.engine.close()
    # A fresh engine, the same name and weights: the store hits (the key is name and content).
    again = make_llm(files, kv_store=url)
    again.generate([prompt], PARAMS, lora_request=LoRARequest("a", 1, str(files["a16"])))
    assert again.get_stats().kv_store.num_hit_tokens == 12
    again.engine.close()


def test_malformed_adapter_configs_are_format_errors(files, tmp_path):
    import json
    import shutil

    from pagedattn.lora.request import LoRAFormatError

    llm = make_llm(files)
    for i, config in enumerate(
        [{"r": [8]}, {"r": float("inf")}, {"r": 8.5}, {"lora_alpha": "x"}, ["a", "list"]]
    ):
        folder = shutil.copytree(files["a8"], tmp_path / f"bad{i}")
        (folder / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(LoRAFormatError):
            llm.add_lora(LoRARequest(f"bad{i}", 10 + i, str(folder)))
