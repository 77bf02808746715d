"""Checks of a checkpoint made before anything loads: one message a user can act on.

A load reads gigabytes and imports transformers; the mistakes a newcomer makes (a folder of an
unsupported architecture, a truncated or mislabelled .gguf file, no tokenizer files, weights in
pytorch_model.bin only) are all visible from the file table and a few small files, in
milliseconds. ``check_checkpoint`` finds them and returns what the caller checks its options
against (the model's context length, whether it has a chat template).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedattn.model.gguf_file import GGUFFileError
from pagedattn.model.gguf_loader import GGUFCheckpoint, GGUFFormatError
from pagedattn.model.hf_loader import HFCheckpoint
from pagedattn.model.loader import ModelNotFoundError, resolve_checkpoint
from pagedattn.model.registry import MODEL_REGISTRY

# Any one of these is a tokenizer transformers can load without converting a slow one.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class CheckpointError(ValueError):
    """``--model`` names a file or folder that cannot be loaded; the message says what to do."""


@dataclass(frozen=True)
class CheckpointFacts:
    """What a checkpoint's small files say, read before loading it."""

    name: str
    max_model_len: int | None  # the model's context length; None where the files do not say
    has_chat_template: bool


def check_checkpoint(model: str | None) -> CheckpointFacts:
    """The facts of the checkpoint ``model`` names; CheckpointError (or the loader's
    ModelNotFoundError) when loading it would fail."""
    try:
        checkpoint = resolve_checkpoint(model)
    except ModelNotFoundError:
        raise
    except GGUFFormatError as exc:
        detail = str(exc).replace(f" of {Path(str(model)).expanduser()}", "")
        raise CheckpointError(f"--model {model}: {detail}") from None
    except (GGUFFileError, struct.error, ValueError, OSError) as exc:
        # NOTE: GGUFFileError names the file; the message names it once, as --model.
        detail = str(exc).replace(str(Path(str(model)).expanduser()), "it").strip(": ")
        if isinstance(exc, struct.error) or not detail:
            detail = "its header is cut short"
        raise CheckpointError(
            f"--model {model} is not a readable GGUF file ({detail}): pass a .gguf file written "
            "by llama.cpp's convert_hf_to_gguf.py, or an HF folder"
        ) from None
    if isinstance(checkpoint, GGUFCheckpoint):
        return _check_gguf(checkpoint)
    return _check_hf_folder(checkpoint)


def _check_gguf(checkpoint: GGUFCheckpoint) -> CheckpointFacts:
    path = checkpoint.path
    size = path.stat().st_size
    end = max((t.offset + t.num_bytes for t in checkpoint.file.tensors), default=0)
    if end > size:
        raise CheckpointError(
            f"--model {path} is truncated: its tensor table needs {end} bytes and the file has "
            f"{size}; download or convert it again"
        )
    length = checkpoint.field(f"{checkpoint.arch}.context_length")
    return CheckpointFacts(
        name=checkpoint.model_name(),
        max_model_len=int(length) if isinstance(length, int) else None,
        has_chat_template=bool(checkpoint.field("tokenizer.chat_template")),
    )


def _check_hf_folder(checkpoint: HFCheckpoint) -> CheckpointFacts:
    folder = checkpoint.path
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"--model {folder}: cannot read config.json ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"--model {folder}: config.json is not a JSON object")
    architectures = config.get("architectures") or []
    supported = [a for a in architectures if a in MODEL_REGISTRY]
    if not supported:
        raise CheckpointError(
            f"--model {folder}: architecture {', '.join(map(str, architectures)) or '(none)'} is "
            f"not supported; pagedattn runs {', '.join(sorted(MODEL_REGISTRY))}"
        )
    if not list(folder.glob("*.safetensors")):
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt*")
        )
        found = f" (it has {', '.join(others[:3])})" if others else ""
        raise CheckpointError(
            f"--model {folder} holds no *.safetensors weights{found}: pagedattn reads safetensors "
            "only; save the model with transformers' save_pretrained(DIR) (safetensors by "
            "default), or pass a .gguf file"
        )
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise CheckpointError(
            f"--model {folder} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, ...): "
            "copy them from the model's original repository into the folder"
        )
    text = config.get("text_config") if supported[0].endswith("ConditionalGeneration") else None
    length = (text or config).get("max_position_embeddings")
    return CheckpointFacts(
        name=checkpoint.model_name(),
        max_model_len=length if isinstance(length, int) else None,
        has_chat_template=_has_chat_template(folder),
    )


def _has_chat_template(folder: Path) -> bool:
    if any((folder / name).is_file() for name in _CHAT_TEMPLATE_FILES):
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))
