"""Read a PEFT LoRA folder into per-module A/B pairs, with the scaling folded into B.

The folder holds adapter_config.json + adapter_model.safetensors; pairs are keyed by HF name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedattn.lora.request import LoRAFormatError, LoRAPathError, LoRARankError

# The projections an adapter may target (HF names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass
class LoRAAdapter:
    """One adapter's weights: (layer, HF module) -> (A [r, in], B [out, r] * scaling)."""

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # blake2b of the config and weights files: the KV cache keys an adapter by it with its name,
    # so other weights loaded under the same name never meet the old adapter's blocks.
    content_hash: str = ""
    # (layer, fused module) -> that layer's padded slot blocks (LoRALinear.pack), made when the
    # adapter is read, off the engine thread; a slot load then only copies them in.
    packed: dict[tuple[int, str], object] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """The engine's id of this adapter: its name and its content."""
        return f"{self.name}#{self.content_hash[:16]}"

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _read_config(folder: Path) -> tuple[dict, bytes]:
    """The parsed adapter_config.json and its bytes."""
    config_path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise LoRAPathError(f"LoRA path {str(folder)!r} is not a folder")
    if not config_path.is_file():
        raise LoRAPathError(f"LoRA path {str(folder)!r} has no adapter_config.json")
    try:
        raw = config_path.read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise LoRAFormatError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoRAFormatError(
            f"{config_path}: the config is a JSON {type(config).__name__}, not an object"
        )
    return config, raw


def _number(config: dict, name: str, default: float, where: str, integer: bool) -> float:
    """config[name] as a finite number (an int if ``integer``); LoRAFormatError otherwise."""
    value = config.get(name, default)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok:
        kind = "an integer" if integer else "a finite number"
        raise LoRAFormatError(f"{where}: {name}={value!r} in adapter_config.json is not {kind}")
    return int(value) if integer else float(value)


def _check_config(config: dict, where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAFormatError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_dora"):
        raise LoRAFormatError(f"{where}: DoRA adapters are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAFormatError(f"{where}: per-module rank_pattern/alpha_pattern is not supported")
    if config.get("modules_to_save"):
        raise LoRAFormatError(f"{where}: modules_to_save (full weights) is not supported")
    if config.get("fan_in_fan_out"):
        raise LoRAFormatError(f"{where}: fan_in_fan_out adapters (GPT-2 Conv1D) are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAFormatError(f"{where}: LoRA bias={config.get('bias')!r} is not supported")


def load_adapter(
    name: str, int_id: int, path: str, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """Load and check an adapter; raises LoRAPathError / LoRAFormatError / LoRARankError."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    folder = Path(path).expanduser()
    config, config_bytes = _read_config(folder)
    where = f"LoRA {name!r} ({folder})"
    _check_config(config, where)
    rank = _number(config, "r", 8, where, integer=True)
    alpha = _number(config, "lora_alpha", 8, where, integer=False)
    if rank < 1:
        raise LoRAFormatError(f"{where}: rank r={rank} must be >= 1")
    if rank > max_rank:
        raise LoRARankError(
            f"{where}: rank {rank} is above max_lora_rank={max_rank}: start the engine with "
            f"--max-lora-rank {rank} or more"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise LoRAPathError(f"{where}: no adapter_model.safetensors (only safetensors is read)")
    try:
        weights_bytes = weights_path.read_bytes()
        tensors = load(weights_bytes)
    except (OSError, SafetensorError, ValueError, RuntimeError) as exc:
        raise LoRAFormatError(f"{where}: cannot read adapter_model.safetensors: {exc}") from exc
    digest = hashlib.blake2b(digest_size=32)
    for part in (config_bytes, weights_bytes):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGET_MODULES:
            raise LoRAFormatError(
                f"{where}: weight {key!r} is not a LoRA of {'/'.join(TARGET_MODULES)}"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    weights = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAFormatError(f"{where}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAFormatError(
                f"{where}: layer {layer} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do "
                f"not have rank r={rank}"
            )
        # NOTE: scaling folded into B in float32, then cast (one rounding, as PEFT's bf16 path).
        weights[(layer, module)] = (a.to(dtype), (b.float() * scaling).to(dtype))
    if not weights:
        raise LoRAFormatError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(name, int_id, str(folder), rank, scaling, weights, digest.hexdigest())


# Every refused runtime path gets this one message, so that a caller cannot tell which server
# paths exist (a folder without adapter_config.json, a missing one, one outside the root).
REFUSED_PATH_MESSAGE = (
    "lora_path is not an adapter folder under the server's adapter root (--lora-root): give a "
    "folder holding adapter_config.json and adapter_model.safetensors, relative to the root"
)


def folder_under_root(root: str, given: str) -> str:
    """The real path of ``given`` (relative to ``root``, or absolute) if it lies under ``root``
    once symlinks and `..` are resolved; else LoRAPathError(REFUSED_PATH_MESSAGE)."""
    try:
        real_root = Path(root).resolve(strict=True)
        folder = (real_root / given).resolve(strict=False)
    except (OSError, ValueError, RuntimeError):
        raise LoRAPathError(REFUSED_PATH_MESSAGE) from None
    if folder == real_root or not folder.is_relative_to(real_root):
        raise LoRAPathError(REFUSED_PATH_MESSAGE)
    return str(folder)
