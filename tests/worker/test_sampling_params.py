"""SamplingParams / BeamSearchParams: validation, normalisation and derived properties."""

from __future__ import annotations

import dataclasses

import pytest

from pagedattn.sampling_params import (
    BeamSearchParams,
    InvalidSamplingParamsError,
    SamplingParams,
    SamplingType,
)


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"n": 0}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_invalid_field_raises_with_field_name(kwargs: dict, field_name: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=rf"^{field_name}="):
        SamplingParams(**kwargs)


def test_invalid_error_is_value_error_and_names_range() -> None:
    with pytest.raises(ValueError, match=r"top_p=1\.5 is invalid: use a number in \(0, 1\]"):
        SamplingParams(top_p=1.5)


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(InvalidSamplingParamsError, match="detokenize"):
        SamplingParams(stop="x", detokenize=False)


def test_defaults_and_normalisation() -> None:
    p = SamplingParams(stop="###", stop_token_ids=None, top_k=-1, temperature=1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == []
    assert p.top_k is None
    assert isinstance(p.temperature, float)
    assert SamplingParams(top_k=0).top_k is None
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == []
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=20).logprobs == 20


def test_greedy_resets_truncation_knobs() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy
    assert p.sampling_type == SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, None, 0.0)


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert not SamplingParams(temperature=0.7).is_greedy


def test_frozen_and_replace_revalidates() -> None:
    p = SamplingParams(max_tokens=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 4  # type: ignore[misc]
    assert dataclasses.replace(p, max_tokens=100).max_tokens == 100
    assert dataclasses.replace(SamplingParams(n=1, best_of=None), n=4).n == 4
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
        dataclasses.replace(p, max_tokens=0)


def test_has_penalties_and_buffer_length() -> None:
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(stop=["ab", "cdef"]).output_text_buffer_length == 3
    assert (
        SamplingParams(stop=["cdef"], include_stop_str_in_output=True).output_text_buffer_length
        == 0
    )
    assert SamplingParams().output_text_buffer_length == 0


def test_beam_search_params() -> None:
    p = BeamSearchParams(beam_width=4, max_tokens=8)
    assert (p.temperature, p.length_penalty, p.ignore_eos) == (0.0, 1.0, False)
    with pytest.raises(InvalidSamplingParamsError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=8)
    with pytest.raises(InvalidSamplingParamsError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(InvalidSamplingParamsError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=-0.5)


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": True}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs"),
    ],
)
def test_boundary_values_raise_with_a_message(kwargs: dict, field_name: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=rf"^{field_name}=.* is invalid: "):
        SamplingParams(**kwargs)


def test_largest_seed_and_logit_bias_accepted() -> None:
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(logit_bias={3: -100, 4: 100.0}).logit_bias == {3: -100, 4: 100.0}


def test_beam_step_params_rank_more_candidates_than_a_client_may_ask_for() -> None:
    params = SamplingParams.for_beam_step(64, max_tokens=9)
    assert params.logprobs == 128 and params.is_greedy and params.ignore_eos
    assert params.max_tokens == 9 and not params.detokenize
    with pytest.raises(InvalidSamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=128)
