"""Tensor-parallel sharding of a PagedCausalLM: what each rank holds and the layers that talk.

vLLM's layout: QKV and gate/up are column-parallel (each rank computes its heads / its slice of
the intermediate size, no communication), o_proj and down_proj are row-parallel (each rank
multiplies its input slice by its slice of the weight's columns, then one all-reduce sums the
partial outputs), the embedding and LM head are vocab-parallel (each rank holds a range of rows;
the embedding all-reduces its masked lookups, the LM head gathers its logits on rank 0). MoE
experts are split the same way inside each expert: every rank holds every expert's slice of the
expert FFN size (gate/up rows, down columns) and the router whole, runs the block on its slices
and all-reduces the block's output once (vLLM's tensor-parallel fused MoE).

A rank's model is the ordinary model class built from a config with the rank's head counts,
intermediate size and vocab rows, with o_proj/down_proj/embed_tokens swapped for the parallel
layers below; its ``load_weights`` slices each checkpoint tensor to the rank's shard, so a rank
never keeps a whole projection. GGUF blocks are sliced as stored: rows (a view), or whole blocks
of columns (a rank whose columns would split a block is refused).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch

from pagedattn.cpu.quant import QuantizedTensor
from pagedattn.model.base import PagedCausalLM
from pagedattn.model.layers import Embedding, Linear
from pagedattn.model.moe import MoETextConfig, SparseMoEBlock
from pagedattn.model.text_config import TextConfig

if TYPE_CHECKING:
    from pagedattn.attention.backends.base import AttentionBackend
    from pagedattn.cpu.plan import KernelPlan
    from pagedattn.distributed.parallel_state import TensorParallelGroup

# Checkpoint names that belong to no text decoder (a multimodal Gemma 3's vision tower).
_NOT_TEXT = ("vision_tower", "multi_modal_projector")
# A checkpoint tensor: float, or GGUF blocks.
Weight = torch.Tensor | QuantizedTensor


class ShardingError(ValueError):
    """The model's heads cannot be split over the asked number of ranks."""


def partition(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part ``index`` of ``total`` items in ``parts`` contiguous near-equal parts
    (the first ``total % parts`` parts get one more)."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


class TPShard(NamedTuple):
    """Which heads, intermediate columns, expert FFN columns and vocab rows one rank holds
    (start, count each)."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    expert_ffn: tuple[int, int]  # of each MoE expert (Qwen3-MoE: moe_intermediate_size)
    vocab: tuple[int, int]  # the real rows; the rank's tables have vocab_per_rank rows
    vocab_per_rank: int
    head_dim: int
    full_vocab_size: int

    @staticmethod
    def plan(config: TextConfig, rank: int, world_size: int) -> TPShard:
        """The shard of ``rank``; ShardingError when the heads do not split over the ranks.

        KV heads are split into contiguous groups (unevenly where they do not divide, each
        rank taking the query heads that read its KV heads); with fewer KV heads than ranks,
        each KV head is replicated on world_size / num_kv_heads ranks (vLLM's rule).
        """
        num_heads, num_kv = config.num_attention_heads, config.num_key_value_heads
        if num_kv >= world_size:
            group = num_heads // num_kv  # query heads per KV head
            kv_start, kv_count = partition(num_kv, world_size, rank)
            q_heads = (kv_start * group, kv_count * group)
        elif world_size % num_kv == 0 and num_heads % world_size == 0:
            kv_start, kv_count = rank // (world_size // num_kv), 1
            q_heads = partition(num_heads, world_size, rank)
        else:
            raise ShardingError(
                f"tensor_parallel_size={world_size} cannot split {num_heads} attention heads "
                f"with {num_kv} KV heads: with fewer KV heads than ranks, the ranks must be a "
                "multiple of the KV heads and divide the attention heads; use a size that does"
            )
        expert_ffn = config.intermediate_size
        if isinstance(config, MoETextConfig) and config.moe_intermediate_size:
            expert_ffn = config.moe_intermediate_size
        if min(config.intermediate_size, expert_ffn) < world_size:
            raise ShardingError(
                f"tensor_parallel_size={world_size} exceeds intermediate_size="
                f"{config.intermediate_size} or the expert FFN size {expert_ffn}"
            )
        per_rank = -(-config.vocab_size // world_size)
        vocab_start = rank * per_rank
        vocab_count = max(0, min(per_rank, config.vocab_size - vocab_start))
        return TPShard(
            rank,
            world_size,
            q_heads,
            (kv_start, kv_count),
            partition(config.intermediate_size, world_size, rank),
            partition(expert_ffn, world_size, rank),
            (vocab_start, vocab_count),
            per_rank,
            config.head_dim,
            config.vocab_size,
        )

    def text_config(self, config: TextConfig) -> TextConfig:
        """``config`` with this rank's head counts, intermediate and expert FFN sizes and vocab
        rows."""
        sharded = dataclasses.replace(
            config,
            num_attention_heads=self.q_heads[1],
            num_key_value_heads=self.kv_heads[1],
            intermediate_size=self.intermediate[1],
            vocab_size=self.vocab_per_rank,
            head_dim=config.head_dim,
        )
        if isinstance(config, MoETextConfig) and config.moe_intermediate_size:
            sharded = dataclasses.replace(sharded, moe_intermediate_size=self.expert_ffn[1])
        return sharded

    def slice_weight(self, name: str, tensor: Weight) -> Weight:
        """This rank's part of the checkpoint tensor ``name`` (HF names): a contiguous copy of a
        float tensor; GGUF blocks split by rows (a view) or by whole blocks of columns.
        ShardingError when a rank's columns would split a block."""
        d = self.head_dim
        rows = None
        if ".experts." in name:  # an expert's gate/up (Mixtral: w1/w3) rows, down (w2) columns
            if name.endswith((".down_proj.weight", ".w2.weight")):
                return _narrow(name, tensor, 1, *self.expert_ffn)
            return _narrow(name, tensor, 0, *self.expert_ffn)
        if ".q_proj." in name:
            rows = (self.q_heads[0] * d, self.q_heads[1] * d)
        elif ".k_proj." in name or ".v_proj." in name:
            rows = (self.kv_heads[0] * d, self.kv_heads[1] * d)
        elif ".gate_proj." in name or ".up_proj." in name:
            rows = self.intermediate
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start, count = self.vocab
            if isinstance(tensor, QuantizedTensor):
                return tensor.narrow(0, start, count).padded(self.vocab_per_rank)
            out = tensor.new_zeros(self.vocab_per_rank, *tensor.shape[1:])
            out[:count] = tensor[start : start + count]  # NOTE: padding rows stay zero
            return out
        elif ".o_proj." in name or ".down_proj." in name:
            if name.endswith(".bias"):
                # NOTE: the partial outputs are summed: only rank 0 adds the bias.
                return tensor.clone() if self.rank == 0 else torch.zeros_like(tensor)
            cols = (
                (self.q_heads[0] * d, self.q_heads[1] * d)
                if ".o_proj." in name
                else self.intermediate
            )
            return _narrow(name, tensor, 1, *cols)
        if rows is None:
            return tensor  # replicated: norms, q/k norms
        return _narrow(name, tensor, 0, *rows)


def _narrow(name: str, tensor: Weight, dim: int, start: int, count: int) -> Weight:
    """Rows or columns [start, start + count) of ``tensor``: a float tensor's as a contiguous
    copy, GGUF blocks' as QuantizedTensor.narrow gives them."""
    if not isinstance(tensor, QuantizedTensor):
        return tensor.narrow(dim, start, count).contiguous()
    try:
        return tensor.narrow(dim, start, count)
    except ValueError as e:
        raise ShardingError(
            f"{name} cannot be split over the ranks as stored ({e}): use a "
            "tensor_parallel_size whose shards hold whole blocks, or float weights "
            "(--weights dequantize for a GGUF file, no --quantization for an HF folder)"
        ) from e


class RowParallelLinear(Linear):
    """A Linear over this rank's input columns; the ranks' partial outputs are all-reduced."""

    def __init__(self, linear: Linear, group: TensorParallelGroup) -> None:
        super().__init__(
            linear.in_features, linear.out_features, linear.bias is not None, linear.kernels
        )
        self.tp_group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_group.all_reduce(super().forward(x))


class RowParallelMoEBlock(SparseMoEBlock):
    """A SparseMoEBlock over this rank's slice of each expert; the ranks' outputs are
    all-reduced."""

    def __init__(self, block: SparseMoEBlock, group: TensorParallelGroup) -> None:
        hidden = block.gate.weight.shape[1]
        super().__init__(
            hidden,
            block.spec,
            block.step_ops,
            block.kernel,
            block.quant_rows,
            block.quant_amx_rows,
        )
        self.tp_group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp_group.all_reduce(super().forward(x))


class VocabParallelEmbedding(Embedding):
    """The embedding rows [start, start + count) of the vocabulary (float, or GGUF blocks); the
    lookups of ids outside them are zero, and the all-reduce fills in each row from the rank
    that holds it."""

    def __init__(
        self, num_rows: int, hidden_size: int, start: int, count: int, group: TensorParallelGroup
    ) -> None:
        super().__init__(num_rows, hidden_size)
        self.start, self.count = start, count
        self.tp_group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.count)  # [T]
        out = super().forward(local.masked_fill(~mask, 0))  # [T, H]
        out.masked_fill_(~mask.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)


class TensorParallelMixin:
    """A model class's rank-local twin: sharded load, gathered logits (see the module doc)."""

    tp_shard: TPShard
    tp_group: TensorParallelGroup

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._sharded(weights))

    def _sharded(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if any(part in name for part in _NOT_TEXT):
                yield name, tensor
            else:
                yield name, self.tp_shard.slice_weight(name, tensor)

    def compute_logits(
        self, hidden: torch.Tensor, verify: bool = False, float32: bool = True
    ) -> torch.Tensor:
        """Rank 0: the full [N, V] logits; other ranks: zeros of that shape (a free view).

        NOTE: only rank 0 samples; the others call this only to send their vocab rows. The rows
        are gathered in float32 whatever ``float32`` asks.
        """
        local = super().compute_logits(hidden, verify)  # [N, vocab_per_rank]
        gathered = self.tp_group.gather_first(local)
        vocab = self.tp_shard.full_vocab_size
        if self.tp_group.is_first:
            return gathered[:, :vocab]  # [N, V]
        return local.new_zeros(()).expand(local.shape[0], vocab)


@functools.cache
def _parallel_class(model_cls: type[PagedCausalLM]) -> type[PagedCausalLM]:
    return type(f"TensorParallel{model_cls.__name__}", (TensorParallelMixin, model_cls), {})


def build_parallel_model(
    model_cls: type[PagedCausalLM],
    config: TextConfig,
    backend: AttentionBackend,
    architecture: str,
    plan: KernelPlan,
    group: TensorParallelGroup,
) -> PagedCausalLM:
    """Rank ``group.rank``'s shard of a ``model_cls`` model of ``config`` (weights not loaded)."""
    shard = TPShard.plan(config, group.rank, group.world_size)
    net = _parallel_class(model_cls)(shard.text_config(config), backend, architecture, plan)
    net.tp_shard, net.tp_group = shard, group
    for layer in net.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, group)
        if isinstance(mlp, SparseMoEBlock):
            layer.mlp = RowParallelMoEBlock(mlp, group)
        else:
            mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    embed = net.model.embed_tokens
    net.model.embed_tokens = VocabParallelEmbedding(
        embed.num_embeddings, embed.embedding_dim, *shard.vocab, group
    )
    return net


def shard_text_config(config: TextConfig, group: TensorParallelGroup) -> TextConfig:
    """The config of rank ``group.rank``'s model (what its kernel plan is chosen for)."""
    return TPShard.plan(config, group.rank, group.world_size).text_config(config)


def shard_key_name(model_name: str, group: TensorParallelGroup) -> str:
    """The model name a rank's KV store keys carry: its blocks hold only its heads."""
    return f"{model_name}@tp{group.world_size}-rank{group.rank}"
