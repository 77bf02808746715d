"""The interface every model implements, plus fused-weight loading and KV cache grouping."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from pagedattn.cpu.linear import PackedLinear, QuantizedParts, pack_quantized, pack_weight
from pagedattn.cpu.plan import KernelPlan
from pagedattn.cpu.quant import QuantizedTensor
from pagedattn.model.layers import Linear, LinearKernels

# HF projection name -> (our fused parameter name, shard index inside it).
STACKED_PARAMS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Checkpoint entries that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _adoptable(tensor: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether ``tensor`` can stand in for ``target`` (dtype, device, contiguous, own storage)."""
    return (
        tensor.dtype == target.dtype
        and tensor.device == target.device
        and tensor.is_contiguous()
        and not tensor.requires_grad
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class WeightLoadError(RuntimeError):
    """A checkpoint does not match the model: missing, unknown or misshaped tensors."""


def linear_kernels(plan: KernelPlan) -> LinearKernels:
    """The kernels of a model's projections under ``plan``."""
    return LinearKernels(
        plan.linear_decode,
        plan.linear_prefill,
        plan.prefill_rows,
        plan.linear_verify,
        plan.quant_prefill_rows,
        plan.quant_amx_rows,
    )


def head_kernels(plan: KernelPlan) -> LinearKernels:
    """The kernel of an (untied) LM head under ``plan``: the same for every row count."""
    return LinearKernels(
        plan.linear_head,
        plan.linear_head,
        verify=plan.linear_verify,
        quant_rows=plan.quant_prefill_rows,
        quant_amx_rows=plan.quant_amx_rows,
    )


def group_layers(layer_windows: list[int | None]) -> tuple[list[int], list[int | None]]:
    """Group layers by sliding window (None = full) in order of first use.

    Returns (layer_group, group_windows): the group index of each layer and each group's window.
    """
    group_windows: list[int | None] = []
    layer_group = []
    for window in layer_windows:
        if window not in group_windows:
            group_windows.append(window)
        layer_group.append(group_windows.index(window))
    return layer_group, group_windows


class PagedCausalLM(nn.Module):
    """A decoder-only LM that reads and writes K/V only through the paged cache.

    Subclasses set the attributes below and build ``self.model`` (embed_tokens, layers, norm)
    with HF's parameter names, except that q/k/v and gate/up are fused into qkv_proj/gate_up_proj.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    layer_group: list[int]  # KV cache group index of each layer
    group_windows: list[int | None]  # sliding window of each group (None = full attention)
    shard_sizes: dict[str, list[int]]  # fused parameter -> output rows of each shard
    tie_word_embeddings: bool
    final_logit_softcapping: float | None = None
    plan: KernelPlan = KernelPlan()  # the CPU kernels the model was built for
    tied_head: PackedLinear | None = None  # a tied LM head's packed copy of the embedding
    tied_head_verify: PackedLinear | None = None  # its copy for verify steps (plan.linear_verify)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the activations (and of the KV cache the runner allocates): the float
        weights' (GGUF blocks run with activations in it too)."""
        return self.model.norm.weight.dtype

    def kv_cache_group_windows(self) -> list[int | None]:
        """Sliding window of each KV cache group; None for full attention."""
        return list(self.group_windows)

    def kv_cache_groups(self, block_size: int) -> list[KVCacheGroupSpec]:
        """One KVCacheGroupSpec per group, naming its layers ``layers.{i}``."""
        groups = []
        for g, window in enumerate(self.group_windows):
            names = tuple(f"layers.{i}" for i, lg in enumerate(self.layer_group) if lg == g)
            spec = (
                FullAttentionSpec(block_size)
                if window is None
                else SlidingWindowSpec(block_size, sliding_window=window)
            )
            groups.append(KVCacheGroupSpec(names, spec))
        return groups

    def lm_head_weight(self) -> torch.Tensor:
        """[V, H] output projection (the embedding when tied), dequantised from GGUF blocks
        where it is held so (a float copy: for tests and tools, not the model's path)."""
        if self.tie_word_embeddings:
            embed = self.model.embed_tokens
            if embed.lookup is not None:
                return embed.lookup.rows(torch.arange(embed.num_embeddings), self.dtype)
            return embed.weight
        head = self.lm_head
        if head.weight is None and head.decode is not None and head.decode.name == "gguf":
            return head.decode.a.rows(torch.arange(head.out_features), self.dtype)
        return head.weight

    def process_weights_after_loading(self) -> None:
        """Pack every Linear's weight for the plan's kernels; a tied LM head gets a packed copy
        of a float embedding (lookups still need the embedding itself), or packs a GGUF table
        that the lookups then read through it."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        table = getattr(self.model.embed_tokens, "quantized", None)
        if self.tie_word_embeddings and table is not None:
            # NOTE: the LM head computes on the embedding's blocks (repacked where its type has
            # an interleaved kernel) and the lookups read the same layer: held once (a repacked
            # table's blocks as stored are let go).
            h = table.cols
            parts = QuantizedParts((table,), (0,), table.shape[0], h)
            self.tied_head = pack_quantized(
                parts, None, self.plan.quant_prefill_rows, amx_rows=self.plan.quant_amx_rows
            )
            self.model.embed_tokens.lookup = self.tied_head.a
            self.model.embed_tokens.quantized = self.tied_head.b.parts[0]
            return
        weight = self.model.embed_tokens.weight
        if self.tie_word_embeddings and weight.device.type == "cpu":
            packed = pack_weight(self.plan.linear_head, weight.detach())
            self.tied_head = None if packed.name == "torch" else packed
            if self.plan.linear_verify is not None:
                verify = pack_weight(self.plan.linear_verify, weight.detach())
                self.tied_head_verify = None if verify.name == packed.name else verify

    def compute_logits(
        self, hidden: torch.Tensor, verify: bool = False, float32: bool = True
    ) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, V] (soft-capped when the model says so).

        verify: the rows score draft tokens (the plan's verify kernel, where it has one).
        float32=False: the LM head's own dtype where no soft cap applies (the sampler widens
        them only where it must; a greedy argmax is the same on them)."""
        verify = verify and 2 <= hidden.shape[0] < self.plan.verify_rows
        if not self.tie_word_embeddings:
            head = self.lm_head
            packed = head.verify if verify and head.verify is not None else None
            logits = packed(hidden) if packed is not None else head(hidden)  # [N, V]
        elif verify and self.tied_head_verify is not None:
            logits = self.tied_head_verify(hidden)  # [N, V]
        elif self.tied_head is not None:
            logits = self.tied_head(hidden)  # [N, V]
        else:
            logits = hidden @ self.lm_head_weight().t()  # [N, V]
        cap = self.final_logit_softcapping
        if float32 or cap is not None:
            logits = logits.float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters, fusing q/k/v and gate/up on the way."""
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            if hf_name.startswith("lm_head.") and self.tie_word_embeddings:
                continue
            name, shard = self._map_name(hf_name)
            if name not in params:
                raise WeightLoadError(
                    f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}; "
                    "the checkpoint does not match this architecture"
                )
            if isinstance(tensor, QuantizedTensor):
                self._load_quantized(name, shard, hf_name, tensor)
                loaded.add((name, -1 if shard is None else shard))
                continue
            target = params[name].data
            if shard is not None:
                sizes = self.shard_sizes[name.split(".")[-2]]
                start = sum(sizes[:shard])
                target = target.narrow(0, start, sizes[shard])
            if target.shape != tensor.shape:
                raise WeightLoadError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)} but "
                    f"{name!r} expects {tuple(target.shape)}; check the config matches the weights"
                )
            if shard is None and _adoptable(tensor, target):
                # NOTE: the loaded tensor becomes the parameter: no copy, and the freshly
                # allocated parameter memory is never touched (no page faults).
                params[name].data = tensor
            else:
                target.copy_(tensor)
            loaded.add((name, -1 if shard is None else shard))
        self._check_all_loaded(params, loaded)

    def _load_quantized(
        self, name: str, shard: int | None, hf_name: str, tensor: QuantizedTensor
    ) -> None:
        """Hand GGUF blocks to the layer that owns parameter ``name`` (a Linear or Embedding
        with load_quantized), at its shard's first row."""
        module = self.get_submodule(name.rpartition(".")[0])
        if not hasattr(module, "load_quantized") or not name.endswith(".weight"):
            raise WeightLoadError(
                f"checkpoint tensor {hf_name!r} is stored as {tensor.name}, which "
                f"{type(module).__name__} cannot run: load with weights='dequantize'"
            )
        start = 0
        if shard is not None:
            sizes = self.shard_sizes[name.split(".")[-2]]
            start = sum(sizes[:shard])
            if tensor.shape[0] != sizes[shard]:
                raise WeightLoadError(
                    f"checkpoint tensor {hf_name!r} has {tensor.shape[0]} rows but shard "
                    f"{shard} of {name!r} has {sizes[shard]}"
                )
        try:
            module.load_quantized(start, tensor)
        except ValueError as e:
            raise WeightLoadError(f"checkpoint tensor {hf_name!r}: {e}") from e

    def _map_name(self, hf_name: str) -> tuple[str, int | None]:
        for hf_part, (fused, shard) in STACKED_PARAMS.items():
            if f".{hf_part}." in hf_name:
                return hf_name.replace(f".{hf_part}.", f".{fused}."), shard
        return hf_name, None

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set) -> None:
        missing = []
        for name in params:
            fused = name.split(".")[-2] if name.count(".") >= 1 else ""
            shards = range(len(self.shard_sizes[fused])) if fused in self.shard_sizes else [-1]
            missing += [
                f"{name}[{s}]" if s >= 0 else name for s in shards if (name, s) not in loaded
            ]
        if missing:
            raise WeightLoadError(
                f"checkpoint lacks {len(missing)} tensors of {type(self).__name__}, e.g. "
                f"{missing[:5]}; the checkpoint is incomplete or of another architecture"
            )
