"""KV cache geometry of a model: bytes per token, from a known name or an HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


class ModelConfigError(ValueError):
    """A model config name or file cannot be turned into a KV cache geometry."""


@dataclass(frozen=True)
class KVGeometry:
    """What one token of KV cache costs for a model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int = 2
    max_seq_len: int = 2048
    # Bytes after each (token, kv head) row: 8 for the u8 cache's float32 scale and min.
    row_extra_bytes: int = 0

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_size", "dtype_bytes", "max_seq_len"):
            if getattr(self, field_name) < 1:
                raise ModelConfigError(f"{self.name}: {field_name} must be >= 1")

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of one K (or one V) vector of one token in one layer."""
        return self.num_kv_heads * (self.head_size * self.dtype_bytes + self.row_extra_bytes)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.bytes_per_token_per_layer


KNOWN_MODELS = {
    g.name: g
    for g in (
        KVGeometry("smollm2-135m", num_layers=30, num_kv_heads=3, head_size=64, max_seq_len=8192),
        KVGeometry("llama-2-7b", num_layers=32, num_kv_heads=32, head_size=128, max_seq_len=4096),
        KVGeometry("llama-2-13b", num_layers=40, num_kv_heads=40, head_size=128, max_seq_len=4096),
        # The PagedAttention paper's main model (A100-40GB, ~12 GB of KV cache).
        KVGeometry("opt-13b", num_layers=40, num_kv_heads=40, head_size=128, max_seq_len=2048),
    )
}


def load_geometry(name_or_path: str) -> KVGeometry:
    """A known model name (``llama-2-7b``) or the path of a HuggingFace ``config.json``."""
    if name_or_path.lower() in KNOWN_MODELS:
        return KNOWN_MODELS[name_or_path.lower()]
    path = Path(name_or_path)
    if not path.is_file():
        raise ModelConfigError(
            f"model config {name_or_path!r} is neither a known name ({sorted(KNOWN_MODELS)}) "
            "nor a config.json file"
        )
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    try:
        num_heads = int(cfg["num_attention_heads"])
        head_size = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
        return KVGeometry(
            name=path.parent.name or path.stem,
            num_layers=int(cfg["num_hidden_layers"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_size=head_size,
            dtype_bytes=_DTYPE_BYTES.get(str(cfg.get("torch_dtype", "float16")), 2),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        )
    except KeyError as e:
        raise ModelConfigError(
            f"{path}: missing {e}; a config.json needs num_hidden_layers, num_attention_heads and "
            "hidden_size (or head_dim)"
        ) from e
