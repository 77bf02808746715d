"""Synthetic checkpoints of real model shapes: seeded random weights, SmolLM2's tokenizer.

    pagedattn bench throughput --synthetic llama-1b [--synthetic-file q4_k_m]
    python -m pagedattn.benchmarks.synthetic llama-3b [--files f16,q8_0,q4_k_m] [--seed 0]

A 135M model says little about the 1-8B models people run on CPUs. A synthetic checkpoint has
the shape of one (Llama 3.2 1B or 3B: hidden size, layers, heads, FFN, tied embeddings, rope
theta) and SmolLM2's vocabulary and tokenizer, built once under ``<cache>/synthetic/<name>``:

- ``hf/``: config.json, bf16 safetensors shards and tokenizer files, for engines that load a folder;
- ``<name>.F16.gguf``: the same numbers in llama.cpp's layout (Q/K rows permuted for its rope),
  written by gguf's GGUFWriter. The numbers are identical, not rounded: every weight is a bf16
  value with magnitudes below 2^-14 flushed to zero, and f16 holds each of those exactly;
- ``<name>.Q8_0.gguf`` and ``<name>.Q4_K_M.gguf``: the F16 file quantised by llama.cpp's own
  quantizer (llama-cpp-python's ``llama_model_quantize``), built when first asked for.

A shape with experts is a Qwen3-MoE (router, per-expert SwiGLU, q/k norm; llama.cpp's qwen3moe
layout in the GGUF files, each projection's experts stacked). Each tensor is generated, written
and dropped in turn, so building the 3B model holds one tensor (at most its 600 MB float32
embedding) in memory, not the model.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import os
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedattn import envs

# What a synthetic checkpoint's files are called: "hf" is the bf16 safetensors folder.
FILE_KINDS = (
    "hf",
    "f16",
    "q8_0",
    "q6_k",
    "q4_k_m",
    "q4_0",
    "q5_k_m",
    "q3_k_m",
    "q2_k",
    "iq4_xs",
    "iq4_nl",
)
# Bump when what is written changes: the cache folder's name carries it.
BUILD_VERSION = 1
# The smallest normal float16: smaller magnitudes are flushed so f16 holds every bf16 value.
F16_MIN_NORMAL = 2.0**-14
SHARD_BYTES = 1 << 30
TOKENIZER_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class SyntheticShape:
    """The hyper-parameters of a Llama-architecture model (vocabulary: SmolLM2's)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    # Normal(0, 0.02), as Llama's initializer: activations stay finite through 28 layers.
    weight_std: float = 0.02
    # MoE shapes (num_experts > 0): Qwen3-MoE layers, every MLP sparse (moe_layer_specs).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads="
                f"{self.num_kv_heads}: heads must divide the hidden size, KV heads the heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES = {
    # Llama-3.2-1B and -3B (their rope scaling left out: the GGUF loader does not take it).
    "llama-1b": SyntheticShape(2048, 16, 32, 8, 8192),
    "llama-3b": SyntheticShape(3072, 28, 24, 8, 8192),
    # Seconds to build: tests and smoke runs of the same code path.
    "llama-tiny": SyntheticShape(64, 2, 4, 2, 128),
    # Qwen3-30B-A3B scaled to a 2-core machine: 32 experts, top-4, expert FFN 512.
    "qwen3-moe-scaled": SyntheticShape(
        1024, 8, 16, 4, 3072, 1e6, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512
    ),
}


@dataclass(frozen=True)
class SyntheticCheckpoint:
    """Where a synthetic model's files are (or will be, once built)."""

    name: str
    root: Path

    @property
    def hf_dir(self) -> Path:
        return self.root / "hf"

    def gguf(self, kind: str) -> Path:
        return self.root / f"{self.name}.{kind.upper()}.gguf"

    def path(self, kind: str) -> Path:
        """The folder ("hf") or GGUF file of ``kind``."""
        return self.hf_dir if kind == "hf" else self.gguf(kind)


def moe_layer_specs(shape: SyntheticShape, layer: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, GGUF name or "" for an expert's, shape) of layer ``layer``'s q/k norms, router
    and experts."""
    hf, h, inter = f"model.layers.{layer}.", shape.hidden_size, shape.moe_intermediate_size
    gg = f"blk.{layer}."
    specs = [
        (hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight", (shape.head_dim,)),
        (hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight", (shape.head_dim,)),
        (hf + "mlp.gate.weight", gg + "ffn_gate_inp.weight", (shape.num_experts, h)),
    ]
    for e in range(shape.num_experts):
        expert = f"{hf}mlp.experts.{e}."
        specs += [
            (expert + "gate_proj.weight", "", (inter, h)),
            (expert + "up_proj.weight", "", (inter, h)),
            (expert + "down_proj.weight", "", (h, inter)),
        ]
    return specs


def expert_stacks(
    shape: SyntheticShape, layer: int
) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """(GGUF name, shape [E, out, in], the experts' HF names) of layer ``layer``'s stacked
    expert tensors, as llama.cpp's qwen3moe stores them."""
    hf, h, inter = f"model.layers.{layer}.", shape.hidden_size, shape.moe_intermediate_size
    stacks = []
    for proj, gguf_name, dims in (
        ("gate_proj", "ffn_gate_exps", (inter, h)),
        ("up_proj", "ffn_up_exps", (inter, h)),
        ("down_proj", "ffn_down_exps", (h, inter)),
    ):
        names = [f"{hf}mlp.experts.{e}.{proj}.weight" for e in range(shape.num_experts)]
        stacks.append((f"blk.{layer}.{gguf_name}.weight", (shape.num_experts, *dims), names))
    return stacks


def moe_config(shape: SyntheticShape, config: dict) -> dict:
    """A Llama config.json dict of ``shape`` turned into Qwen3-MoE's (every layer sparse)."""
    return config | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "use_sliding_window": False,
        "sliding_window": None,
    }


def tensor_specs(shape: SyntheticShape, vocab_size: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, GGUF name, shape [out, in]) of every tensor, embeddings first."""
    h, q, kv = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    )
    specs = [("model.embed_tokens.weight", "token_embd.weight", (vocab_size, h))]
    for i in range(shape.num_layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        specs += [
            (hf + "input_layernorm.weight", gg + "attn_norm.weight", (h,)),
            (hf + "self_attn.q_proj.weight", gg + "attn_q.weight", (q, h)),
            (hf + "self_attn.k_proj.weight", gg + "attn_k.weight", (kv, h)),
            (hf + "self_attn.v_proj.weight", gg + "attn_v.weight", (kv, h)),
            (hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (h, q)),
            (hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (h,)),
        ]
        if shape.num_experts:
            specs += moe_layer_specs(shape, i)
            continue
        specs += [
            (hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (shape.intermediate_size, h)),
            (hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (shape.intermediate_size, h)),
            (hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (h, shape.intermediate_size)),
        ]
    return specs + [("model.norm.weight", "output_norm.weight", (h,))]


def random_tensor(name: str, shape: tuple[int, ...], seed: int, std: float) -> torch.Tensor:
    """The bf16 tensor ``name`` (norms: ones), the same for the same name, seed and std."""
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    w = torch.randn(shape, generator=gen).mul_(std)
    w[w.abs() < F16_MIN_NORMAL] = 0.0
    return w.to(torch.bfloat16)


def permute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for its rope (as its convert_hf_to_gguf.py writes it)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    """An exclusive lock on ``root``, so two processes never build the same files at once."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _tokenizer_source():
    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import packaged_model_path

    return GGUFCheckpoint(packaged_model_path(TOKENIZER_MODEL))


def _vocab_size() -> int:
    return len(_tokenizer_source().file.fields["tokenizer.ggml.tokens"])


def hf_config(shape: SyntheticShape, vocab_size: int) -> dict:
    """config.json in the classic form that transformers 4.x and 5.x both read."""
    source = _tokenizer_source()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": source.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": source.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": source.field("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",
    }
    return moe_config(shape, config) if shape.num_experts else config


def _shards(specs: list[tuple[str, str, tuple[int, ...]]]) -> list[list[int]]:
    """Indices of specs per safetensors shard, each about SHARD_BYTES of bf16 at most."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, _, shape) in enumerate(specs):
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def write_hf_folder(dest: Path, shape: SyntheticShape, seed: int) -> None:
    """The bf16 HF checkpoint: sharded safetensors with an index, config, tokenizer files."""
    from safetensors.torch import save_file

    vocab_size = _vocab_size()
    specs = tensor_specs(shape, vocab_size)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + "."))
    shards = _shards(specs)
    weight_map, total = {}, 0
    for n, indices in enumerate(shards):
        file = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {
            specs[i][0]: random_tensor(specs[i][0], specs[i][2], seed, shape.weight_std)
            for i in indices
        }
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(hf_config(shape, vocab_size), indent=1))
    _tokenizer_source().hf_tokenizer().save_pretrained(tmp)
    tmp.chmod(0o755)
    tmp.rename(dest)


def gguf_tensors(
    shape: SyntheticShape, specs: list[tuple[str, str, tuple[int, ...]]]
) -> list[tuple[str, tuple[int, ...], list[str]]]:
    """(GGUF name, shape, the HF tensors it holds) of every GGUF tensor: one HF tensor each, but
    an MoE layer's experts, stacked per projection."""
    tensors = [(gguf_name, dims, [hf_name]) for hf_name, gguf_name, dims in specs if gguf_name]
    for layer in range(shape.num_layers if shape.num_experts else 0):
        tensors += expert_stacks(shape, layer)
    return tensors


def write_f16_gguf(dest: Path, hf_dir: Path, shape: SyntheticShape, name: str) -> None:
    """The HF folder's numbers as an F16 GGUF (norms and the MoE router F32), tensor by tensor:
    llama architecture, or qwen3moe for an MoE shape."""
    import gguf
    from safetensors import safe_open

    source = gguf.GGUFReader(str(_tokenizer_source().path))
    specs = tensor_specs(shape, len(source.fields["tokenizer.ggml.tokens"].contents()))
    arch = "qwen3moe" if shape.num_experts else "llama"
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(specs[0][2][0])
    if shape.num_experts:
        writer.add_expert_count(shape.num_experts)
        writer.add_expert_used_count(shape.num_experts_per_tok)
        writer.add_expert_feed_forward_length(shape.moe_intermediate_size)
    for field in source.fields.values():
        if field.name.startswith("tokenizer."):
            val_type = field.types[0]
            sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    tensors = gguf_tensors(shape, specs)

    def stored_dtype(gguf_name: str, dims: tuple[int, ...]) -> type:
        # NOTE: llama.cpp's converter keeps norms and the router in F32 (its quantizer too).
        return np.float32 if len(dims) == 1 or "ffn_gate_inp" in gguf_name else np.float16

    for gguf_name, dims, _ in tensors:
        dtype = np.dtype(stored_dtype(gguf_name, dims))
        writer.add_tensor_info(gguf_name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    for gguf_name, dims, hf_names in tensors:
        parts = []
        for hf_name in hf_names:
            with safe_open(str(hf_dir / weight_map[hf_name]), framework="pt") as f:
                parts.append(f.get_tensor(hf_name).float().numpy())
        w = parts[0] if len(parts) == 1 else np.stack(parts)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = shape.num_heads if "attn_q" in gguf_name else shape.num_kv_heads
            w = permute_qk(w, heads)
        writer.write_tensor_data(np.ascontiguousarray(w, dtype=stored_dtype(gguf_name, dims)))
        del w, parts
    writer.close()
    os.replace(tmp, dest)


def quantize_gguf(src: Path, dest: Path, kind: str, threads: int) -> None:
    """``src`` quantised to ``kind`` (q8_0, q6_k, q4_k_m, q4_0, q5_k_m, q3_k_m, q2_k, iq4_xs,
    iq4_nl) by llama.cpp's quantizer."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise RuntimeError(
            f"building {dest.name} needs llama-cpp-python (llama.cpp's quantizer): "
            '`pip install "llama-cpp-python==0.3.36"` (make bench-peers installs it)'
        ) from exc
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}")
    params.nthread = threads
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src.name} -> {kind}) returned {rc}")
    os.replace(tmp, dest)


def synthetic_checkpoint(
    name: str,
    kinds: tuple[str, ...] = ("hf", "f16"),
    *,
    seed: int = 0,
    shape: SyntheticShape | None = None,
    cache_dir: Path | None = None,
    threads: int = 2,
) -> SyntheticCheckpoint:
    """The synthetic model ``name`` (one of SHAPES, or any name with ``shape``) with the files of
    ``kinds`` built; files built before are reused."""
    unknown = sorted(set(kinds) - set(FILE_KINDS))
    if unknown:
        raise ValueError(
            f"unknown synthetic file kinds {unknown}: choose from {', '.join(FILE_KINDS)}"
        )
    if shape is None:
        if name not in SHAPES:
            raise ValueError(f"no synthetic model {name!r}: choose from {', '.join(SHAPES)}")
        shape = SHAPES[name]
    root = (
        cache_dir or envs.PAGEDATTN_CACHE_DIR / "synthetic"
    ) / f"{name}-seed{seed}-v{BUILD_VERSION}"
    ckpt = SyntheticCheckpoint(name, root)
    with _locked(root):
        # NOTE: every GGUF is made from the F16 file, which is made from the HF folder.
        needed = set(kinds) | ({"hf", "f16"} if set(kinds) - {"hf"} else {"hf"})
        for kind in FILE_KINDS:
            path = ckpt.path(kind)
            if kind not in needed or path.exists():
                continue
            print(f"building synthetic {name}: {path}", flush=True)
            if kind == "hf":
                write_hf_folder(path, shape, seed)
            elif kind == "f16":
                write_f16_gguf(path, ckpt.hf_dir, shape, name)
            else:
                quantize_gguf(ckpt.gguf("f16"), path, kind, threads)
    return ckpt


def benchmark_files(name: str, kind: str, threads: int = 2) -> tuple[str, str, str]:
    """(what pagedattn runs, the HF folder, the GGUF llama.cpp runs) of synthetic ``name`` with
    ``kind`` (hf: the HF folder, and for llama.cpp the F16 GGUF of the same numbers)."""
    gguf_kind = "f16" if kind == "hf" else kind
    ckpt = synthetic_checkpoint(name, ("hf", gguf_kind), threads=threads)
    return str(ckpt.path(kind)), str(ckpt.hf_dir), str(ckpt.gguf(gguf_kind))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("name", choices=sorted(SHAPES))
    p.add_argument(
        "--files", default=",".join(FILE_KINDS), help=f"comma list of {', '.join(FILE_KINDS)}"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="threads of llama.cpp's quantizer")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.files.split(",") if k.strip())
    ckpt = synthetic_checkpoint(args.name, kinds, seed=args.seed, threads=args.threads)
    for kind in kinds:
        print(f"{kind}: {ckpt.path(kind)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
