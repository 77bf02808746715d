"""A tiny model served from stored blocks: same logits and greedy tokens as computing them.

Process A prefills a prompt's full blocks, saves them through one connector per KV cache group,
and goes on; a fresh cache (another process, after a restart) loads those blocks into other block
ids and computes only the rest. Its logits must equal A's bit for bit, in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedattn.core.kv_cache_utils import hash_request_tokens
from pagedattn.kv_transfer.connector import KVConnector
from pagedattn.kv_transfer.file_store import FileKVStore
from pagedattn.model import load_model
from pagedattn.model.base import PagedCausalLM
from tests.model.paged_driver import PagedDriver
from tests.model.tiny import make_tiny_gemma3, make_tiny_llama

BLOCK_SIZE = 4
NUM_PREFIX_BLOCKS = 5
NUM_NEW_TOKENS = 6


def group_connectors(model: PagedCausalLM, root: Path) -> list[KVConnector]:
    """One connector per KV cache group, over that group's layers."""
    return [
        KVConnector(
            FileKVStore(root),
            "tiny",
            "flash",
            torch.float32,
            BLOCK_SIZE,
            group_id=g,
            layer_indices=[i for i, lg in enumerate(model.layer_group) if lg == g],
        )
        for g in range(len(model.kv_cache_group_windows()))
    ]


def run_suffix(driver: PagedDriver, suffix: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Feed the prompt's suffix, then decode greedily; the logits of every step and the tokens."""
    logits = [driver.step([(0, suffix)])[0]]
    tokens = [int(logits[-1][-1].argmax())]
    while len(tokens) < NUM_NEW_TOKENS:
        logits.append(driver.step([(0, [tokens[-1]])])[0])
        tokens.append(int(logits[-1][-1].argmax()))
    return logits, tokens


@pytest.mark.parametrize("maker", [make_tiny_llama, make_tiny_gemma3], ids=["llama", "gemma3"])
def test_loaded_prefix_gives_identical_logits(tmp_path: Path, maker, monkeypatch) -> None:
    # NOTE: PyTorch kernels only: this checks the KV round trip, and never waits on a C++ build.
    monkeypatch.setenv("PAGEDATTN_DISABLE_CPU_EXT", "1")
    model = load_model(str(maker(tmp_path / "ckpt")), "float32", "cpu", "torch").model
    num_prefix = NUM_PREFIX_BLOCKS * BLOCK_SIZE
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 128, (num_prefix + 3,), generator=gen).tolist()
    block_hashes = hash_request_tokens(BLOCK_SIZE, prompt, "seed")[:NUM_PREFIX_BLOCKS]

    cold = PagedDriver(model, block_size=BLOCK_SIZE, seed=0)
    cold.step([(0, prompt[:num_prefix])])
    for g, conn in enumerate(group_connectors(model, tmp_path / "kv")):
        table = cold.block_tables[0][g][:NUM_PREFIX_BLOCKS]
        assert conn.save_blocks(cold.kv_caches, table, block_hashes) == NUM_PREFIX_BLOCKS
        conn.close()
    cold_logits, cold_tokens = run_suffix(cold, prompt[num_prefix:])

    def warm_driver(load: bool) -> PagedDriver:
        driver = PagedDriver(model, block_size=BLOCK_SIZE, seed=1)  # other block ids
        driver._grow(0, num_prefix)  # NOTE: the blocks a scheduler would allocate for the hit
        for g, conn in enumerate(group_connectors(model, tmp_path / "kv")):
            assert conn.get_num_new_matched_tokens(block_hashes, 0) == num_prefix
            table = driver.block_tables[0][g]
            assert table != cold.block_tables[0][g][:NUM_PREFIX_BLOCKS]
            if load:
                assert conn.load_blocks(driver.kv_caches, table, block_hashes) == len(table)
            conn.close()
        driver.num_computed[0] = num_prefix
        return driver

    warm_logits, warm_tokens = run_suffix(warm_driver(load=True), prompt[num_prefix:])
    assert warm_tokens == cold_tokens
    for warm, cold_step in zip(warm_logits, cold_logits, strict=True):
        assert torch.equal(warm, cold_step)
    # Control: the same suffix over an empty cache gives other logits, so the check can fail.
    unloaded_logits, _ = run_suffix(warm_driver(load=False), prompt[num_prefix:])
    assert not torch.allclose(unloaded_logits[0], cold_logits[0])
