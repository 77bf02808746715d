"""The sparse mixture-of-experts block: a softmax top-k router over SwiGLU experts.

Experts are loaded stacked, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (or as GGUF
blocks per expert, kept as stored), then packed per expert for the plan's linear kernel and
computed grouped: the (token, expert) pairs are sorted by expert, each active expert runs one
GEMM pair on its rows, and the weighted rows are added into the output. With the extension this
runs as one fused C++ call (csrc/moe_cpu.cpp, ``MoEExperts``); ``grouped_moe`` is the same
computation in PyTorch (the reference, and the path without the extension). A step reads only
the weights of the experts its tokens chose (at batch 1, top-k of them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedattn.config import ConfigError
from pagedattn.cpu import extension
from pagedattn.cpu.linear import (
    GGUF_PREFILL_ROWS,
    PackedLinear,
    QuantizedParts,
    compiled_linear,
    pack_quantized,
    pack_weight,
)
from pagedattn.cpu.quant import QuantizedTensor
from pagedattn.model.base import WeightLoadError
from pagedattn.model.layers import silu_and_mul
from pagedattn.model.text_config import TextConfig


class MoECheckpointError(ConfigError):
    """An MoE checkpoint pagedattn cannot run; the message names the config value or tensor."""


class UnsupportedMoEError(MoECheckpointError):
    """The checkpoint's routing variant (shared experts, a non-softmax router) is not run here."""


class MissingExpertError(MoECheckpointError, WeightLoadError):
    """The checkpoint lacks (or misshapes) an expert's tensor."""


@dataclass(frozen=True)
class MoETextConfig(TextConfig):
    """TextConfig plus the MoE keys of Qwen3-MoE and Mixtral config.json files."""

    num_experts: int | None = None  # Qwen3-MoE's name
    num_local_experts: int | None = None  # Mixtral's (transformers 5 maps Qwen3-MoE's to it)
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    # Keys of routing variants this block does not run (refused by MoESpec.from_config).
    scoring_func: str | None = None
    shared_expert_intermediate_size: int | None = None
    n_shared_experts: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MoETextConfig:
        """The config of a config.json dict (``mlp_only_layers`` as a tuple)."""
        raw = dict(raw)
        if raw.get("mlp_only_layers") is not None:
            raw["mlp_only_layers"] = tuple(raw["mlp_only_layers"])
        config = super().from_dict(raw)
        assert isinstance(config, MoETextConfig)
        return config


# Keys of a MoETextConfig that TextConfig lacks (what a plain TextConfig cannot carry).
MOE_KEYS = tuple(
    f.name for f in fields(MoETextConfig) if f.name not in TextConfig.__dataclass_fields__
)


@dataclass(frozen=True)
class MoESpec:
    """What one sparse block computes: E experts of FFN size I, top-k of them per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool  # divide the top-k probabilities by their sum

    @staticmethod
    def from_config(
        config: TextConfig, intermediate_size: int | None, renormalize: bool | None
    ) -> MoESpec:
        """The block of ``config``; UnsupportedMoEError names the value it cannot run."""
        if not isinstance(config, MoETextConfig):
            raise UnsupportedMoEError(
                f"model_type={config.model_type!r}: an MoE model needs its MoE config keys "
                f"({', '.join(MOE_KEYS[:4])}, ...)"
            )
        name = config.model_type
        shared = config.shared_expert_intermediate_size or config.n_shared_experts
        if shared:
            raise UnsupportedMoEError(
                f"{name}: shared experts (shared_expert_intermediate_size / n_shared_experts="
                f"{shared}, as in Qwen2-MoE and DeepSeek) are not supported; pagedattn runs "
                "Qwen3-MoE and Mixtral routing (softmax top-k, no shared expert)"
            )
        if config.scoring_func not in (None, "softmax"):
            raise UnsupportedMoEError(
                f"{name}: scoring_func={config.scoring_func!r} is not supported; only softmax "
                "routing is"
            )
        if config.hidden_act != "silu":
            raise UnsupportedMoEError(
                f"{name}: experts with hidden_act={config.hidden_act!r} are not supported; "
                "only silu (SwiGLU) experts are"
            )
        num_experts = config.num_experts or config.num_local_experts
        top_k = config.num_experts_per_tok
        if not num_experts or not top_k or not 1 <= top_k <= num_experts:
            raise UnsupportedMoEError(
                f"{name}: num_experts={num_experts}, num_experts_per_tok={top_k}: an MoE model "
                "needs 1 <= num_experts_per_tok <= num_experts"
            )
        if not intermediate_size:
            raise UnsupportedMoEError(f"{name}: the config gives no expert FFN size")
        return MoESpec(num_experts, top_k, intermediate_size, bool(renormalize))


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (float32 weights [T, k], expert ids [T, k]): softmax, top-k."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# An expert's projection: its [out, in] weight (run by F.linear) or the weight packed for a
# linear kernel (pagedattn.cpu.linear.PackedLinear, called on the rows).
Projection = torch.Tensor | PackedLinear


def _project(proj: Projection, rows: torch.Tensor) -> torch.Tensor:
    return F.linear(rows, proj) if isinstance(proj, torch.Tensor) else proj(rows)


def grouped_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor | Sequence[Projection],
    down: torch.Tensor | Sequence[Projection],
    weights: torch.Tensor,
    ids: torch.Tensor,
    step_ops: bool = True,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t: x [T, H] -> [T, H].

    gate_up [E, 2I, H] and down [E, H, I], or E projections each (packed weights); weights
    (float32) and ids [T, k]. The T * k pairs are sorted by expert and each active expert runs
    once on its rows.
    """
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)  # [T * k]
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    token_of = order // top_k  # [T * k] the token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=len(gate_up)).tolist()
    rows = x.index_select(0, token_of)  # [T * k, H]
    out_rows = torch.empty_like(rows)  # [T * k, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        hidden = _project(gate_up[expert], rows[start:end])  # [count, 2I]
        out_rows[start:end] = _project(down[expert], silu_and_mul(hidden, step_ops))
        start = end
    scale = weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [T * k, 1]
    out_rows = (out_rows * scale).to(x.dtype)
    out = torch.zeros_like(x)  # [T, H]
    out.index_add_(0, token_of, out_rows)
    return out


class MoERouter(nn.Module):
    """The router's linear map (HF ``mlp.gate``): hidden [T, H] -> logits [T, E]."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class MoEExperts(nn.Module):
    """E SwiGLU experts' weights, stacked (the fused gate/up first, as the dense MLP's)."""

    def __init__(self, hidden_size: int, spec: MoESpec) -> None:
        super().__init__()
        e, i = spec.num_experts, spec.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))  # [E, H, I]


class SparseMoEBlock(nn.Module):
    """Router, top-k, grouped experts, weighted sum: hidden [T, H] -> [T, H]."""

    def __init__(
        self,
        hidden_size: int,
        spec: MoESpec,
        step_ops: bool = True,
        kernel: str | None = None,
        quant_rows: int = GGUF_PREFILL_ROWS,
        quant_amx_rows: int = 0,
    ) -> None:
        """kernel: the linear kernel each expert's projections are packed for after loading
        (the plan's decode kernel); None: F.linear on the stacked weights. quant_rows: rows
        from which experts stored as GGUF blocks dequantise tiles, quant_amx_rows: from which
        their interleaved parts run on AMX-INT8 tiles (0: never; both the plan's)."""
        super().__init__()
        self.spec = spec
        self.step_ops = step_ops
        self.kernel = kernel
        self.quant_rows, self.quant_amx_rows = quant_rows, quant_amx_rows
        self.gate = MoERouter(hidden_size, spec.num_experts)
        self.experts = MoEExperts(hidden_size, spec)
        # GGUF blocks of experts' projections (ExpertLoader): (parameter, expert, shard) -> blocks.
        self.quantized: dict[tuple[str, int, int | None], QuantizedTensor] = {}
        self.packed: tuple[list[PackedLinear], list[PackedLinear]] | None = None
        self.router: PackedLinear | None = None  # the router's weight packed for ``kernel``
        self.fused = None  # the extension's MoEExperts over ``packed``

    def process_weights_after_loading(self) -> None:
        """Pack the router and each expert's gate/up and down weights for ``kernel`` (where it
        takes them; experts stored as GGUF blocks for the gguf kernel as they are), and build
        the fused block over them; the stacked parameters then hold no memory of their own."""
        experts = self.experts
        if experts.gate_up_proj.device.type != "cpu":
            return
        ext = extension.load_extension() if self.kernel is not None else None
        quantized = self.quantized
        whole = len(quantized) == 3 * self.spec.num_experts  # every expert's three projections
        if quantized and (not whole or ext is None or not hasattr(ext, "QuantLinear")):
            # NOTE: no gguf kernel here, or float experts beside quantised ones: all run as floats.
            self._widen_quantized()
            quantized = {}
        if self.kernel is None:
            return
        # NOTE: F.linear on bf16 without native bf16 instructions is ~30x slower than packed.
        router = pack_weight(self.kernel, self.gate.weight.detach())
        self.router = None if router.name == "torch" else router
        if quantized:
            gate_up, down = self._pack_quantized()
        else:
            # NOTE: the torch kernel keeps views of the stacked weights (which stay alive).
            gate_up = [pack_weight(self.kernel, w) for w in experts.gate_up_proj.detach()]
            down = [pack_weight(self.kernel, w) for w in experts.down_proj.detach()]
        self.packed = (gate_up, down)
        # NOTE: the packed copies are the weights now: free the stacked ones.
        experts.gate_up_proj.data = experts.gate_up_proj.data.new_empty(0)
        experts.down_proj.data = experts.down_proj.data.new_empty(0)
        if self.step_ops and ext is not None and hasattr(ext, "MoEExperts"):
            self.fused = ext.MoEExperts(
                [compiled_linear(ext, p) for p in gate_up], [compiled_linear(ext, p) for p in down]
            )

    def _pack_quantized(self) -> tuple[list[PackedLinear], list[PackedLinear]]:
        """Each expert's GGUF blocks packed for the gguf kernel (gate and up as one layer)."""
        spec, hidden = self.spec, self.gate.weight.shape[1]
        size = spec.intermediate_size
        gate_up, down = [], []
        for e in range(spec.num_experts):
            parts = (self.quantized[("gate_up_proj", e, 0)], self.quantized[("gate_up_proj", e, 1)])
            fused = QuantizedParts(parts, (0, size), 2 * size, hidden)
            rows, amx_rows = self.quant_rows, self.quant_amx_rows
            gate_up.append(pack_quantized(fused, None, rows, amx_rows=amx_rows))
            blocks = self.quantized[("down_proj", e, None)]
            down_parts = QuantizedParts((blocks,), (0,), hidden, size)
            down.append(pack_quantized(down_parts, None, rows, amx_rows=amx_rows))
        self.quantized = {}
        return gate_up, down

    def _widen_quantized(self) -> None:
        """Dequantise the experts' GGUF blocks into the stacked float parameters."""
        for key, blocks in self.quantized.items():
            self.expert_rows(*key).copy_(blocks.dequantize())
        self.quantized = {}

    def expert_rows(self, param: str, expert: int, shard: int | None) -> torch.Tensor:
        """The stacked parameter ``param``'s rows of one expert: [2I, H] or [H, I], or the gate
        (shard 0) or up (shard 1) half [I, H] of gate_up_proj."""
        target = getattr(self.experts, param).data[expert]
        if shard is None:
            return target
        size = self.spec.intermediate_size
        return target.narrow(0, shard * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        router = self.router
        logits = F.linear(x, self.gate.weight) if router is None else router(x)  # [T, E]
        weights, ids = route(logits, self.spec.top_k, self.spec.renormalize)
        if self.fused is not None:
            return self.fused.forward(x, weights, ids)
        if self.packed is not None:
            return grouped_moe(x, *self.packed, weights, ids, self.step_ops)
        experts = self.experts
        return grouped_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, self.step_ops)


# HF per-expert tensor: "<layer>.mlp.experts.<e>.<proj>.weight".
_EXPERT_TENSOR = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
# A stacked tensor as transformers 5 holds it: "<layer>.mlp.experts.gate_up_proj".
_STACKED_TENSOR = re.compile(r"^(?P<block>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)$")


class ExpertLoader:
    """Copies per-expert HF tensors into the stacked parameters and checks none is missing.

    ``projections`` maps the checkpoint's names of an expert's projections to (stacked
    parameter, shard): 0/1 the gate/up halves of gate_up_proj, None the whole down_proj row.
    """

    def __init__(self, model: nn.Module, projections: dict[str, tuple[str, int | None]]) -> None:
        self.projections = projections
        self.blocks: dict[str, SparseMoEBlock] = {
            name: m for name, m in model.named_modules() if isinstance(m, SparseMoEBlock)
        }
        self.loaded: set[tuple[str, int, str]] = set()  # (block, expert, HF projection)

    def filter(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The tensors that are not experts' (experts' are copied into place on the way)."""
        for name, tensor in weights:
            if "shared_expert" in name:
                raise UnsupportedMoEError(
                    f"checkpoint tensor {name!r} is a shared expert (Qwen2-MoE / DeepSeek "
                    "routing): pagedattn runs MoE models without shared experts"
                )
            match = _EXPERT_TENSOR.match(name)
            if match and match["block"] in self.blocks:
                self._copy(name, match["block"], int(match["expert"]), match["proj"], tensor)
                continue
            match = _STACKED_TENSOR.match(name)
            if match and match["block"] in self.blocks:
                spec = self.blocks[match["block"]].spec
                for proj, (param, _) in self.projections.items():
                    if param == match["proj"]:
                        self.loaded.update(
                            (match["block"], e, proj) for e in range(spec.num_experts)
                        )
            yield name, tensor

    def _copy(self, name: str, block: str, expert: int, proj: str, tensor: Any) -> None:
        if proj not in self.projections:
            raise MissingExpertError(
                f"checkpoint tensor {name!r}: experts have no projection {proj!r} here (expected "
                f"{', '.join(self.projections)})"
            )
        moe = self.blocks[block]
        if expert >= moe.spec.num_experts:
            raise MissingExpertError(
                f"checkpoint tensor {name!r} names expert {expert}, but the config has "
                f"{moe.spec.num_experts} experts"
            )
        param, shard = self.projections[proj]
        target = moe.expert_rows(param, expert, shard)
        if target.shape != tensor.shape:
            raise MissingExpertError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)} but the expert "
                f"expects {tuple(target.shape)}: check num_experts and the expert FFN size"
            )
        if isinstance(tensor, QuantizedTensor):
            if tensor.row_order is not None:
                raise UnsupportedMoEError(f"checkpoint tensor {name!r}: expert rows permuted")
            moe.quantized[(param, expert, shard)] = tensor  # NOTE: kept as stored, not copied
        else:
            target.copy_(tensor)
        self.loaded.add((block, expert, proj))

    def check_complete(self) -> None:
        """MissingExpertError naming the first expert tensor the checkpoint lacked."""
        for block, moe in self.blocks.items():
            for expert in range(moe.spec.num_experts):
                for proj in self.projections:
                    if (block, expert, proj) not in self.loaded:
                        raise MissingExpertError(
                            f"checkpoint lacks expert tensor '{block}.experts.{expert}.{proj}."
                            "weight': the checkpoint is incomplete or its num_experts is wrong"
                        )

    def stacked_names(self) -> set[str]:
        """Parameter names this loader fills (the base loader must not count them)."""
        names = set()
        for block in self.blocks:
            names |= {f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"}
        return names
