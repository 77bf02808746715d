"""Tensor-parallel sharding: which heads, columns and vocab rows each rank holds."""

from __future__ import annotations

import pytest
import torch

from pagedattn.model.parallel_layers import ShardingError, TPShard, partition
from pagedattn.model.text_config import TextConfig


def _config(num_heads: int, num_kv: int, vocab: int = 100, inter: int = 96) -> TextConfig:
    return TextConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=8 * num_heads,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def test_partition_covers_every_item_once():
    for total in (1, 5, 9, 96):
        for parts in (1, 2, 3):
            if parts > total:
                continue
            spans = [partition(total, parts, i) for i in range(parts)]
            covered = [j for start, size in spans for j in range(start, start + size)]
            assert covered == list(range(total))
            assert max(s for _, s in spans) - min(s for _, s in spans) <= 1


def test_kv_heads_split_unevenly_and_query_heads_follow_them():
    # SmolLM2-135M: 9 query heads reading 3 KV heads (3 each), on 2 ranks.
    shards = [TPShard.plan(_config(9, 3), rank, 2) for rank in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 2), (2, 1)]
    assert [s.q_heads for s in shards] == [(0, 6), (6, 3)]


def test_fewer_kv_heads_than_ranks_are_replicated():
    # Gemma 3 270M: 4 query heads, 1 KV head.
    shards = [TPShard.plan(_config(4, 1), rank, 2) for rank in range(2)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1)]
    assert [s.q_heads for s in shards] == [(0, 2), (2, 2)]
    shards = [TPShard.plan(_config(8, 2), rank, 4) for rank in range(4)]
    assert [s.kv_heads[0] for s in shards] == [0, 0, 1, 1]
    with pytest.raises(ShardingError, match="tensor_parallel_size=4"):
        TPShard.plan(_config(6, 3), 0, 4)


def test_vocab_rows_are_padded_to_equal_tables():
    shards = [TPShard.plan(_config(4, 2, vocab=101), rank, 2) for rank in range(2)]
    assert [s.vocab for s in shards] == [(0, 51), (51, 50)]
    embed = torch.arange(101 * 3, dtype=torch.float32).reshape(101, 3)
    last = shards[1].slice_weight("model.embed_tokens.weight", embed)
    assert last.shape == (51, 3)
    assert torch.equal(last[:50], embed[51:]) and not last[50].any()


def test_slices_follow_the_column_and_row_parallel_layout():
    shard = TPShard.plan(_config(4, 2), 1, 2)  # heads 2-3, KV head 1, columns 48-95
    q = torch.randn(32, 32)
    assert torch.equal(shard.slice_weight("model.layers.0.self_attn.q_proj.weight", q), q[16:])
    k = torch.randn(16, 32)
    assert torch.equal(shard.slice_weight("model.layers.0.self_attn.k_proj.weight", k), k[8:])
    o = torch.randn(32, 32)
    assert torch.equal(shard.slice_weight("model.layers.0.self_attn.o_proj.weight", o), o[:, 16:])
    down = torch.randn(32, 96)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(shard.slice_weight(name, down), down[:, 48:])
    bias = torch.randn(32)
    assert not shard.slice_weight("model.layers.0.mlp.down_proj.bias", bias).any()
    norm = torch.randn(32)
    assert shard.slice_weight("model.layers.0.input_layernorm.weight", norm) is norm


def test_experts_split_their_own_ffn_size_and_the_router_is_whole():
    """Qwen3-MoE: every expert's gate/up rows and down columns of moe_intermediate_size (not the
    dense intermediate_size) per rank; Mixtral's w1/w3/w2 alike; the router replicated."""
    import dataclasses

    from pagedattn.model.moe import MoETextConfig

    base = dataclasses.asdict(_config(4, 2))
    config = MoETextConfig(**base | {"model_type": "qwen3_moe"}, moe_intermediate_size=40)
    shard = TPShard.plan(config, 1, 2)
    assert shard.intermediate == (48, 48) and shard.expert_ffn == (20, 20)
    assert shard.text_config(config).moe_intermediate_size == 20
    gate, down = torch.randn(40, 32), torch.randn(32, 40)
    prefix = "model.layers.0.mlp.experts.3."
    assert torch.equal(shard.slice_weight(prefix + "gate_proj.weight", gate), gate[20:])
    assert torch.equal(shard.slice_weight(prefix + "down_proj.weight", down), down[:, 20:])
    w2 = torch.randn(32, 40)
    mixtral = "model.layers.0.block_sparse_moe.experts.0.w2.weight"
    assert torch.equal(shard.slice_weight(mixtral, w2), w2[:, 20:])
    router = torch.randn(8, 32)
    assert shard.slice_weight("model.layers.0.mlp.gate.weight", router) is router
