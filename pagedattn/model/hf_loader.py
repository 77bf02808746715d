"""HF checkpoint folders: config.json, (sharded) *.safetensors and tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from pagedattn.model.registry import UnsupportedArchitectureError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

_INDEX_FILE = "model.safetensors.index.json"


class HFCheckpoint:
    """A local HF checkpoint folder."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._config: dict[str, Any] | None = None

    def model_name(self) -> str:
        """The folder name."""
        return self.path.resolve().name

    def config(self) -> dict[str, Any]:
        """The config.json dict as transformers normalises it (``hf_config().to_dict()``)."""
        if self._config is None:
            self._config = json.loads(json.dumps(self.hf_config().to_dict(), default=str))
        return self._config

    def hf_config(self) -> PreTrainedConfig:
        """config.json through transformers (old and new rope formats normalised)."""
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(self.path, local_files_only=True)
        except (KeyError, ValueError) as exc:
            raw = json.loads((self.path / "config.json").read_text())
            raise UnsupportedArchitectureError(
                f"cannot read {self.path / 'config.json'} (model_type="
                f"{raw.get('model_type')!r}, architectures={raw.get('architectures')!r}): {exc}"
            ) from exc

    def safetensors_files(self) -> list[Path]:
        """The weight files: those the shard index names, else every *.safetensors."""
        index = self.path / _INDEX_FILE
        if index.exists():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.path / n for n in names]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no *.safetensors weights in {self.path}: pagedattn loads safetensors "
                "checkpoints (or a .gguf file)"
            )
        return files

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of every weight file, under its checkpoint name."""
        for file in self.safetensors_files():
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The folder's tokenizer (with its chat template), through transformers."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, local_files_only=True)

    def generation_eos_token_ids(self) -> list[int]:
        """eos_token_id of generation_config.json (int or list), if the file exists."""
        path = self.path / "generation_config.json"
        if not path.exists():
            return []
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)
