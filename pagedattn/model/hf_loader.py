"""HF checkpoint folders: config.json, (sharded) *.safetensors and tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedattn.model.registry import UnsupportedArchitectureError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

_INDEX_FILE = "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header


class SafetensorsFormatError(ValueError):
    """A *.safetensors file whose header or data does not read as one."""


def read_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors file, in file order, each read into memory of its own.

    NOTE: not memory-mapped (safetensors' safe_open maps the whole file): a mapped file's pages
    count in the process's RSS for as long as any one tensor of it lives (an adopted embedding
    or norm), beside the packed copies the kernels make of the rest. A 1B bf16 model held
    4.6 GiB, 2.1 of them the mapped files; read so, the file's pages stay in the page cache.
    """
    path = Path(path)
    with open(path, "rb", buffering=0) as f:
        size = path.stat().st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER_BYTES, size - 8):
            raise SafetensorsFormatError(f"{path} is not a safetensors file (no valid header)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsFormatError(f"{path}: the safetensors header is not JSON: {e}") from e
        entries = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
        for name, info in entries:
            start, end = info["data_offsets"]
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise SafetensorsFormatError(
                    f"{path}: tensor {name!r} has dtype {info['dtype']}, which pagedattn does "
                    f"not read (use one of {', '.join(_SAFETENSORS_DTYPES)})"
                )
            raw = torch.empty(end - start, dtype=torch.uint8)
            f.seek(8 + n + start)
            view, done = memoryview(raw.numpy()), 0
            while done < len(view):
                got = f.readinto(view[done:])
                if not got:
                    raise SafetensorsFormatError(f"{path} ends inside tensor {name!r}")
                done += got
            yield name, raw.view(dtype).reshape(info["shape"])


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
            yield from read_safetensors(file)

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
