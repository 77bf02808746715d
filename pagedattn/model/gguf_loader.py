"""GGUF checkpoints: config from the metadata, weights under HF names (as stored or dequantised),
tokenizer."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file

from pagedattn import envs
from pagedattn.cpu.quant import QuantizedTensor, has_kernel, type_name
from pagedattn.disk_cache import cache_root, read_json, write_atomic
from pagedattn.model.gemma3 import FULL, SLIDING
from pagedattn.model.gguf_file import GGUFFile, TensorInfo
from pagedattn.model.hf_loader import read_safetensors
from pagedattn.model.text_config import TextConfig
from pagedattn.tokenizer import LightTokenizer, TokenizerFormatError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

# llama.cpp architecture -> (HF model_type, HF architecture).
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# A "llama" file with experts (expert_count > 0) is Mixtral.
_MIXTRAL = ("mixtral", "MixtralForCausalLM")

# llama.cpp per-layer tensor -> HF name inside ``model.layers.{i}.``.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate_inp": "mlp.gate",
}
# llama.cpp's stacked expert tensors [E, rows, cols] -> each expert's HF projection (Qwen3-MoE's
# names; Mixtral's are w1/w3/w2).
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# ffn_norm is the norm before the MLP: Llama calls it post_attention_layernorm, Gemma 3 pre_ffn.
_FFN_NORM = {"gemma3": "pre_feedforward_layernorm"}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

WEIGHT_CACHE_VERSION = 1  # bump when the conversions in _dequantised change
WEIGHT_CACHE_MIN_BYTES = 16 << 20  # smaller files convert in well under a second
# The config and tokenizer that transformers converts once per file (any size): bump when what is
# saved changes.
META_CACHE_VERSION = 1
_CONFIG_FILE = "config.json"

# llama.cpp defaults for Gemma 3 that the file does not state.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_27B_NUM_LAYERS = 62


class GGUFFormatError(ValueError):
    """A GGUF file lacks what loading needs, or uses an architecture not supported here."""


# The bytes of the interleaved layouts QuantLinear repacks these types into, over the stored
# bytes (Q4_K's and Q5_K's scales held as bytes: 148 and 180 per row and superblock, not 144
# and 176); every other type with kernels is repacked into as many bytes as stored.
X8_GROWTH = {"Q4_K": 148 / 144, "Q5_K": 180 / 176}


class GGUFCheckpoint:
    """An open GGUF file: its metadata, config, tokenizer and weights.

    The config and tokenizer are built by transformers on the first load of a file and cached
    (``gguf_meta/`` under the cache root, keyed by the file's path, size and mtime and the
    transformers version); later loads read them back without importing transformers.
    """

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        self.path = Path(path)
        self.name = name
        self.file = GGUFFile(self.path)
        self.arch = str(self.field("general.architecture"))
        if self.arch not in GGUF_ARCHITECTURES:
            raise GGUFFormatError(
                f"GGUF architecture {self.arch!r} of {self.path} is not supported; supported: "
                f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        self.tensor_names = {t.name for t in self.file.tensors}
        self._config: dict[str, Any] | None = None

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value (scalar, string or small list), or ``default`` when absent."""
        return self.file.fields.get(key, default)

    def model_name(self) -> str:
        """The name given at construction, else the file name without its extension."""
        return self.name or self.path.stem

    def config(self) -> dict[str, Any]:
        """The config.json dict (``hf_config().to_dict()``), from the cache after the first load."""
        if self._config is None:
            path = _meta_cache_dir(self.path) / _CONFIG_FILE
            config = read_json(path)
            if not config:
                config = json.loads(json.dumps(self.hf_config().to_dict(), default=str))
                write_atomic(path, json.dumps(config, indent=1).encode())
            self._config = config
        return self._config

    def hf_config(self) -> PreTrainedConfig:
        """A transformers config equal to what the original checkpoint's config.json says."""
        from transformers import AutoConfig

        arch = self.arch
        model_type, architecture = self._architecture()
        num_experts = self.field(f"{arch}.expert_count", 0)
        if "rope_freqs.weight" in self.tensor_names:
            raise GGUFFormatError(
                f"{self.path} carries per-dimension rope frequency factors (Llama 3.1 style), "
                "which the GGUF loader does not support: load the HF checkpoint folder instead"
            )
        num_heads = self.field(f"{arch}.attention.head_count")
        hidden_size = self.field(f"{arch}.embedding_length")
        head_dim = self.field(f"{arch}.attention.key_length", hidden_size // num_heads)
        kwargs: dict[str, Any] = {
            "architectures": [architecture],
            "hidden_size": hidden_size,
            "intermediate_size": self.field(f"{arch}.feed_forward_length"),
            "num_hidden_layers": self.field(f"{arch}.block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": self.field(f"{arch}.attention.head_count_kv", num_heads),
            "head_dim": head_dim,
            "rms_norm_eps": self.field(f"{arch}.attention.layer_norm_rms_epsilon"),
            "max_position_embeddings": self.field(f"{arch}.context_length"),
            "rope_theta": self.field(f"{arch}.rope.freq_base", 10000.0),
            "vocab_size": len(self.file.fields["tokenizer.ggml.tokens"]),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
        }
        scaling = self.field(f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            factor = self.field(f"{arch}.rope.scaling.factor")
            kwargs["rope_scaling"] = {"rope_type": scaling, "factor": factor}
        if arch == "qwen2":
            kwargs["use_sliding_window"] = False
        if num_experts:
            used = self.field(f"{arch}.expert_used_count")
            kwargs |= {"num_experts_per_tok": used}
            if model_type == "mixtral":
                kwargs["num_local_experts"] = num_experts
            else:  # NOTE: llama.cpp runs every qwen3moe layer sparse, top-k renormalised
                kwargs |= {
                    "num_experts": num_experts,
                    "moe_intermediate_size": self.field(f"{arch}.expert_feed_forward_length"),
                    "norm_topk_prob": True,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [],
                }
        if arch == "gemma3":
            num_layers = kwargs["num_hidden_layers"]
            scalar = hidden_size // num_heads if num_layers == _GEMMA3_27B_NUM_LAYERS else head_dim
            pattern = self.field(f"{arch}.attention.sliding_window_pattern")
            if isinstance(pattern, list):  # one flag per layer: True = sliding window
                kwargs["layer_types"] = [SLIDING if p else FULL for p in pattern]
            else:
                kwargs["sliding_window_pattern"] = pattern or _GEMMA3_SLIDING_WINDOW_PATTERN
            kwargs |= {
                "sliding_window": self.field(f"{arch}.attention.sliding_window"),
                "rope_local_base_freq": self.field(
                    f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA
                ),
                "query_pre_attn_scalar": scalar,
                "final_logit_softcapping": self.field(f"{arch}.final_logit_softcapping"),
                "attn_logit_softcapping": self.field(f"{arch}.attn_logit_softcapping"),
            }
        return AutoConfig.for_model(model_type, **kwargs)

    def weights(
        self, config: TextConfig, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Dequantised tensors under HF names, with llama.cpp's conversions undone.

        Without ``dtype``: float32, computed. With it: in ``dtype``, from a cache of this file's
        converted tensors (``gguf_weights/`` under the cache root, keyed by path, size, mtime)
        that the first load writes (files of WEIGHT_CACHE_MIN_BYTES or more);
        PAGEDATTN_WEIGHT_CACHE=0 turns the cache off.
        """
        uncached = self.path.stat().st_size < WEIGHT_CACHE_MIN_BYTES
        if dtype is None or uncached or not envs.PAGEDATTN_WEIGHT_CACHE:
            for name, w in self._dequantised(config):
                yield name, w if dtype is None else w.to(dtype)
            return
        path = _weights_cache_path(self.path, dtype)
        if path.is_file():
            try:
                tensors = list(read_safetensors(path))
            except Exception:  # NOTE: a damaged cache file is rewritten below
                tensors = None
            if tensors is not None:
                yield from tensors
                return
        converted = {}
        for name, w in self._dequantised(config):
            converted[name] = w.to(dtype)
            yield name, converted[name]
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file(converted, str(tmp))
            os.replace(tmp, path)
        except OSError:  # an unwritable cache only costs load time
            tmp.unlink(missing_ok=True)

    def every_matrix_has_kernels(self) -> bool:
        """Whether every matrix (and stack of experts' matrices) is of a type the gguf kernel
        runs as stored."""
        return all(_runs_as_stored(t) for t in self.file.tensors if len(t.shape) >= 2)

    def quantized_weights(
        self, config: TextConfig, dtype: torch.dtype, ranks: int = 1
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """The weights under HF names, each 2-D tensor of a type with kernels (Q2_K ... IQ4_XS) as
        its stored blocks (QuantizedTensor: a view of the file's memory map, nothing copied),
        every other tensor dequantised to ``dtype``. Prints one line per stored type: how many
        tensors, their bytes and the format they run in (the whole model's, where ``ranks``
        tensor-parallel ranks each take their shard of it)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        # type -> [tensors, bytes in the file, bytes held]
        summary: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        for tensor in self.file.tensors:
            name = self._hf_name(tensor.name)
            kind = type_name(tensor.tensor_type)
            rows_cols, cols = tensor.shape, tensor.shape[-1]
            if _runs_as_stored(tensor):
                with warnings.catch_warnings():  # NOTE: read-only map: the kernels only read it
                    warnings.simplefilter("ignore", UserWarning)
                    data = torch.from_numpy(self.file.tensor_bytes(tensor))
                order = None
                if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = config.num_attention_heads
                    if name.endswith("k_proj.weight"):
                        heads = config.num_key_value_heads
                    order = _stored_row_order(rows_cols[0], heads)
                # NOTE: QuantLinear repacks rows in eights (quant_x8_cpu.h): Q4_K's and
                # Q5_K's scales then take bytes (148 and 180 per row and superblock).
                untied_table = (
                    name.endswith("embed_tokens.weight") and not config.tie_word_embeddings
                )
                x8 = rows_cols[-2] % 8 == 0 and not untied_table
                entry = summary[(kind, "interleaved 8 rows" if x8 else "as stored")]
                entry[0] += 1
                entry[1] += tensor.num_bytes
                entry[2] += round(tensor.num_bytes * X8_GROWTH.get(kind, 1.0))
                # NOTE: the whole map's pages, not the tensor's: the kernel maps pages around
                # each fault too, and those of tensors already repacked stayed resident.
                drop = self.file.release_pages
                if data.dim() == 3:  # stacked experts: each expert's rows, a view of them
                    names = self._expert_names(name, data.shape[0])
                    for expert, expert_name in enumerate(names):
                        part = QuantizedTensor(tensor.tensor_type, data[expert], cols, release=drop)
                        yield expert_name, part
                    continue
                yield name, QuantizedTensor(tensor.tensor_type, data, cols, order, drop)
                continue
            raw = self.file.tensor_bytes(tensor)
            w = dequantize(raw, GGMLQuantizationType(tensor.tensor_type)).reshape(tensor.shape)
            w = np.ascontiguousarray(self._converted(name, w, config))
            # NOTE: an F32 tensor is a view of the read-only map: the loader copies it.
            w = torch.from_numpy(w if w.flags.writeable else w.copy()).to(dtype)
            held = "dequantised" if len(rows_cols) >= 2 else "float"
            entry = summary[(kind, f"{held} to {str(dtype).removeprefix('torch.')}")]
            entry[0] += 1
            entry[1] += tensor.num_bytes
            entry[2] += w.numel() * w.element_size()
            yield from self._split_experts(name, w)
        for (kind, held), (count, stored, total) in summary.items():
            extra = ""
            if held.startswith("dequantised"):
                extra = f" (no kernel for {kind}: costs {(total - stored) / 2**20:.1f} MiB more)"
            if ranks > 1:
                extra += f"; split over {ranks} ranks, each holds its shard"
            print(
                f"[weights] {kind} x {count}: {stored / 2**20:.1f} MiB in the file, "
                f"{total / 2**20:.1f} MiB held, {held}{extra}",
                file=sys.stderr,
            )

    def _converted(self, name: str, w: np.ndarray, config: TextConfig) -> np.ndarray:
        """A dequantised tensor with llama.cpp's conversions undone (float32)."""
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # NOTE: llama.cpp permutes Q/K rows for its interleaved rope; undo it for HF's.
            is_q = name.endswith("q_proj.weight")
            num_heads = config.num_attention_heads if is_q else config.num_key_value_heads
            w = unpermute_qk(w, num_heads)
        if self.arch == "gemma3" and name.endswith("norm.weight"):
            # NOTE: llama.cpp stores Gemma norms as (1 + w); HF (and we) keep w.
            w = w - 1.0
        return np.ascontiguousarray(w, dtype=np.float32)

    def _dequantised(self, config: TextConfig) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        for tensor in self.file.tensors:
            name = self._hf_name(tensor.name)
            w = dequantize(self.file.tensor_bytes(tensor), GGMLQuantizationType(tensor.tensor_type))
            w = self._converted(name, w.reshape(tensor.shape), config)  # [out, in] (numpy order)
            yield from self._split_experts(
                name, torch.from_numpy(w if w.flags.writeable else w.copy())
            )

    def _split_experts(self, name: str, w: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, w), or for stacked experts [E, rows, cols] each expert's (name, rows)."""
        if w.dim() != 3:
            yield name, w
            return
        yield from zip(self._expert_names(name, w.shape[0]), w.unbind(0), strict=True)

    def _expert_names(self, name: str, num_experts: int) -> list[str]:
        """The HF names of each expert's projection of a stacked ``...mlp.experts.<proj>`` name."""
        block, _, rest = name.partition(".experts.")
        proj, _, kind = rest.partition(".")
        if self._architecture() == _MIXTRAL:
            proj = _MIXTRAL_EXPERTS[proj]
        return [f"{block}.experts.{e}.{proj}.{kind}" for e in range(num_experts)]

    def _architecture(self) -> tuple[str, str]:
        """(HF model_type, HF architecture) of the file: a "llama" file with experts is Mixtral."""
        if self.arch == "llama" and self.field("llama.expert_count", 0):
            return _MIXTRAL
        return GGUF_ARCHITECTURES[self.arch]

    def _hf_name(self, gguf_name: str) -> str:
        match = _LAYER_RE.fullmatch(gguf_name)
        if match is not None:
            layer, part, kind = match.groups()
            hf_part = _FFN_NORM.get(self.arch, "post_attention_layernorm")
            hf_part = hf_part if part == "ffn_norm" else _LAYER_TENSORS.get(part)
            if part in _EXPERT_TENSORS:
                hf_part = f"mlp.experts.{_EXPERT_TENSORS[part]}"
            if hf_part is not None:
                return f"model.layers.{layer}.{hf_part}.{kind}"
        else:
            base, _, kind = gguf_name.rpartition(".")
            if base in _GLOBAL_TENSORS:
                return f"{_GLOBAL_TENSORS[base]}.{kind}"
        raise GGUFFormatError(
            f"GGUF tensor {gguf_name!r} in {self.path} has no HF counterpart for arch {self.arch!r}"
        )

    def tokenizer(self) -> LightTokenizer:
        """The tokenizer (and chat template) stored in the file.

        The first load converts it with transformers (which re-reads the whole file: seconds)
        and caches the result as tokenizer.json and its settings; later loads read those.
        """
        cache = _meta_cache_dir(self.path)
        try:
            return LightTokenizer.load(cache, name_or_path=str(self.path))
        except TokenizerFormatError:
            pass  # not converted yet (or a damaged cache): convert and save again
        tokenizer = LightTokenizer.from_hf(self.hf_tokenizer())
        tokenizer.name_or_path = str(self.path)
        try:
            tokenizer.save(cache)
        except OSError:  # an unwritable cache only costs load time
            pass
        return tokenizer

    def hf_tokenizer(self) -> PreTrainedTokenizerBase:
        """The file's tokenizer converted by transformers (seconds; uncached)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            str(self.path.parent), gguf_file=self.path.name, local_files_only=True
        )


def _runs_as_stored(tensor: TensorInfo) -> bool:
    """Whether a GGUF tensor is a matrix (or a stack of experts' matrices) of a type the gguf
    kernel runs as stored."""
    return len(tensor.shape) in (2, 3) and has_kernel(tensor.tensor_type, tensor.shape[-1])


def _file_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def _meta_cache_dir(path: Path) -> Path:
    """Where the config and tokenizer converted from GGUF file ``path`` are cached."""
    key = f"{_file_key(path)}|transformers {version('transformers')}|v{META_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_root() / "gguf_meta" / digest


def _weights_cache_path(path: Path, dtype: torch.dtype) -> Path:
    """Where the tensors of GGUF file ``path`` converted to ``dtype`` are cached."""
    key = f"{_file_key(path)}|{dtype}|gguf {version('gguf')}|v{WEIGHT_CACHE_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_root() / "gguf_weights" / f"{digest}.safetensors"


# HF tensors --quantization turns into GGUF blocks: the projections (experts' too: Mixtral's are
# w1/w2/w3), the LM head, the embedding. The MoE router (mlp.gate) stays float, as in llama.cpp.
_QUANTIZED_SUFFIXES = (
    "_proj.weight",
    ".w1.weight",
    ".w2.weight",
    ".w3.weight",
    "lm_head.weight",
    "embed_tokens.weight",
)


def quantize_checkpoint(
    weights: Iterator[tuple[str, torch.Tensor]], kind: str, ranks: int = 1
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """``weights`` (HF names) with each 2-D projection, LM head and embedding quantised to the
    GGUF block type ``kind`` (q8_0, q4_0, ...), where its columns are whole blocks; the rest
    as they come. Prints one line: how many tensors were quantised, and their bytes (the whole
    model's, where ``ranks`` tensor-parallel ranks each take their shard)."""
    from pagedattn.cpu.quant import GGUF_TYPES, quantize

    block = GGUF_TYPES[kind][1]
    count = before = after = 0
    for name, w in weights:
        if w.dim() == 2 and name.endswith(_QUANTIZED_SUFFIXES) and w.shape[1] % block == 0:
            q = quantize(w, kind)
            count, before, after = (
                count + 1,
                before + w.numel() * w.element_size(),
                after + q.nbytes,
            )
            yield name, q
        else:
            yield name, w
    print(
        f"[weights] {kind.upper()} x {count}: quantised at load, {before / 2**20:.1f} MiB -> "
        f"{after / 2**20:.1f} MiB" + (f"; split over {ranks} ranks" if ranks > 1 else ""),
        file=sys.stderr,
    )


def _stored_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """Where each row llama.cpp stored (permuted, see unpermute_qk) belongs in HF's order."""
    source = unpermute_qk(np.arange(num_rows)[:, None], num_heads)[:, 0]  # HF row -> stored row
    return torch.from_numpy(np.argsort(source)).to(torch.int32)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows [heads, D/2, 2] back to [heads, 2, D/2]).

    llama.cpp wrote ``w.reshape(heads, 2, D/2, in).swapaxes(1, 2)``; this is its inverse.
    """
    out_features = w.shape[0]
    half = out_features // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
