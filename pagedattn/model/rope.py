"""Rotary embedding frequencies per rope type (default, linear, llama3, yarn), as in transformers.

Each function takes one standardised rope parameter dict (``config.rope_parameters``, or one
layer type's entry of it) and returns ``(inv_freq [head_size // 2], attention_scaling)``.
tests/model/test_rope.py checks every type against transformers' ROPE_INIT_FUNCTIONS.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponent)  # [dim // 2]


def _rotary_dim(params: dict, head_size: int) -> int:
    return int(head_size * params.get("partial_rotary_factor", 1.0))


def _default(params: dict, head_size: int, max_positions: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], _rotary_dim(params, head_size)), 1.0


def _linear(params: dict, head_size: int, max_positions: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(params["rope_theta"], _rotary_dim(params, head_size))
    return inv_freq / params["factor"], 1.0


def _llama3(params: dict, head_size: int, max_positions: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(params["rope_theta"], _rotary_dim(params, head_size))
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the middle band interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict, head_size: int, max_positions: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    dim = _rotary_dim(params, head_size)
    original = params["original_max_position_embeddings"]
    factor = params["factor"]
    if factor is None:
        factor = max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: as transformers does, against a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # [dim // 2]: 1 where the frequency is extrapolated unchanged
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


ROPE_FUNCTIONS: dict[str, Callable[[dict, int, int], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_frequencies(
    params: dict, head_size: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] float32 on the CPU, attention scaling) of one rope config."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_FUNCTIONS:  # e.g. "dynamic", "longrope": depend on the length so far
        raise NotImplementedError(
            f"rope_type={rope_type!r} is not supported: use a checkpoint with "
            f"{', '.join(repr(t) for t in ROPE_FUNCTIONS)} rope"
        )
    with torch.device("cpu"):  # NOTE: overrides a surrounding meta-device context
        return ROPE_FUNCTIONS[rope_type](params, head_size, max_position_embeddings)
