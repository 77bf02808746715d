"""LoRAManager: the loaded adapters, the LRU slots of the stacked buffers, and each step's slots."""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from pagedattn.cpu import extension
from pagedattn.lora.adapter import LoRAAdapter, load_adapter
from pagedattn.lora.layers import NO_SLOT, LoRABatch, LoRALinear
from pagedattn.lora.request import (
    LoRAError,
    LoRAExistsError,
    LoRAFormatError,
    LoRANotFoundError,
    LoRARequest,
)

# Our fused module -> the HF modules of its output slices, in order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoRAManager:
    """Wraps the model's projections once; loads adapters (CPU copies, any number) and keeps at
    most ``max_loras`` of them resident in slots, evicting the least recently used."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        compiled: bool = True,
    ):
        """compiled: run the CPU extension's LoRA kernel for every step where it can (False:
        the torch path only, the reference)."""
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        self.batch = LoRABatch()
        self.model = model
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        device = next(model.parameters()).device
        self.device = device
        kernel = None
        if compiled and device.type == "cpu" and dtype in extension.SUPPORTED_DTYPES:
            kernel = extension.get_extension()
        for index, layer in enumerate(model.model.layers):
            for parent in (layer.self_attn, layer.mlp):
                for name, hf_names in FUSED_MODULES.items():
                    base = getattr(parent, name, None)
                    if base is None:
                        continue
                    slices = model.shard_sizes.get(name, [base.out_features])
                    assert len(slices) == len(hf_names)
                    wrapped = LoRALinear(
                        base, slices, max_loras, max_rank, self.batch, dtype, device, kernel
                    )
                    setattr(parent, name, wrapped)
                    self.layers[(index, name)] = wrapped
        # NOTE: the compiled decode stacks read the same slot buffers and the step's slots.
        for stack in (getattr(model, "decode_stack", None), getattr(model, "verify_stack", None)):
            if stack is not None:
                stack.set_lora(self.batch, self.layers)
        self.adapters: dict[str, LoRAAdapter] = {}  # by name
        # NOTE: a step names adapters by key (name and content: adapter.key), as its requests'
        # block hashes do; slots are keyed the same way.
        self.by_key: dict[str, LoRAAdapter] = {}
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident key -> slot, LRU first
        self.num_slot_loads = 0
        self.slot_load_s = 0.0  # time spent copying adapters into slots

    # Adapters in and out.

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """Load and check an adapter's files (no engine state touched: any thread may call)."""
        adapter = load_adapter(
            request.lora_name, request.lora_int_id, request.lora_path, self.max_rank, self.dtype
        )
        self._check_shapes(adapter)
        self._pack(adapter)
        return adapter

    def _pack(self, adapter: LoRAAdapter) -> None:
        """Each layer's padded slot blocks of ``adapter`` (layer state untouched: any thread)."""
        for (layer_index, fused), layer in self.layers.items():
            adapter.packed[(layer_index, fused)] = layer.pack(
                [adapter.weights.get((layer_index, hf)) for hf in FUSED_MODULES[fused]]
            )

    def add(self, adapter: LoRAAdapter) -> None:
        """Register a read adapter; LoRAExistsError if its name or id is taken."""
        if adapter.name in self.adapters:
            raise LoRAExistsError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        for other in self.adapters.values():
            if other.int_id == adapter.int_id:
                raise LoRAExistsError(
                    f"LoRA id {adapter.int_id} is already used by adapter {other.name!r}"
                )
        self.adapters[adapter.name] = adapter
        self.by_key[adapter.key] = adapter

    def remove(self, name: str) -> None:
        """Forget an adapter and free its slot; LoRANotFoundError if it is not loaded."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRANotFoundError(f"no LoRA adapter named {name!r} is loaded")
        del self.by_key[adapter.key]
        slot = self.slots.pop(adapter.key, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.set_slot(slot, None)

    def _check_shapes(self, adapter: LoRAAdapter) -> None:
        for (layer_index, module), (a, b) in adapter.weights.items():
            fused = next(f for f, names in FUSED_MODULES.items() if module in names)
            layer = self.layers.get((layer_index, fused))
            if layer is None:
                raise LoRAFormatError(
                    f"LoRA {adapter.name!r}: layer {layer_index} {module} is not in the model"
                )
            out = layer.slices[FUSED_MODULES[fused].index(module)]
            if a.shape[1] != layer.in_features or b.shape[0] != out:
                raise LoRAFormatError(
                    f"LoRA {adapter.name!r}: layer {layer_index} {module} has A "
                    f"{tuple(a.shape)}, B {tuple(b.shape)}; the model needs A [r, "
                    f"{layer.in_features}], B [{out}, r]: an adapter of another base model?"
                )

    # Slots.

    def _slot_for(self, key: str, step_keys: set[str]) -> int:
        slot = self.slots.get(key)
        if slot is not None:
            self.slots.move_to_end(key)
            return slot
        if len(self.slots) < self.max_loras:
            used = set(self.slots.values())
            slot = next(s for s in range(self.max_loras) if s not in used)
        else:
            victim = next((k for k in self.slots if k not in step_keys), None)
            if victim is None:
                raise LoRAError(
                    f"{len(step_keys)} adapters in one step, more than max_loras={self.max_loras}"
                )
            slot = self.slots.pop(victim)
        adapter = self.by_key[key]
        start = time.perf_counter()
        if not adapter.packed:  # NOTE: read() packs it; an adapter made another way packs here
            self._pack(adapter)
        for key, layer in self.layers.items():
            layer.set_slot(slot, adapter.packed[key])
        self.slots[key] = slot
        self.num_slot_loads += 1
        self.slot_load_s += time.perf_counter() - start
        return slot

    @contextlib.contextmanager
    def activate(
        self, lora_names: Sequence[str | None], num_tokens: Sequence[int]
    ) -> Iterator[None]:
        """For one forward: each sequence's adapter (by key; None: base) over its
        ``num_tokens`` rows."""
        names = {n for n in lora_names if n is not None}
        if not names:
            yield
            return
        for name in names:
            if name not in self.by_key:
                raise LoRANotFoundError(f"LoRA adapter {name!r} is not loaded")
        slot_of = {name: self._slot_for(name, names) for name in names}
        seq_slots = np.array(
            [NO_SLOT if n is None else slot_of[n] for n in lora_names], dtype=np.int64
        )
        rows = np.repeat(seq_slots, np.asarray(num_tokens, dtype=np.int64))
        self.batch.set(torch.from_numpy(rows).to(self.device))
        try:
            yield
        finally:
            self.batch.set(None)
