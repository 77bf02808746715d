"""Limits on what one request may ask for (issue 21): siblings, beam width, token ids."""

from __future__ import annotations

import pytest

from pagedattn import LLM, BeamSearchParams, SamplingParams
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.sampling_params import MAX_NUM_SEQS_PER_REQUEST, InvalidSamplingParamsError
from tests.model.tiny import TINY_VOCAB_SIZE, make_tiny_llama

PROMPT = [5, 9, 11, 7, 3, 8, 21, 30, 4, 6, 12, 14, 15, 16, 17, 18, 19, 20, 22]  # 19 tokens


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("llama"))
    return LLM(path, dtype="float32", num_blocks=512, block_size=4, max_num_seqs=64)


def _assert_idle(llm):
    assert llm.get_stats().kv_cache_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_a_wide_beam_search_runs(llm):
    # Each beam ranks 2 * 64 = 128 candidates: past the 20 logprobs a client may ask for.
    params = BeamSearchParams(beam_width=64, max_tokens=2, ignore_eos=True)
    (out,) = llm.beam_search([PROMPT], params)
    assert len(out.sequences) == 64
    assert len({tuple(s.token_ids) for s in out.sequences}) == 64
    scores = [s.score for s in out.sequences]
    assert scores == sorted(scores, reverse=True)
    _assert_idle(llm)


def test_more_siblings_than_the_engine_runs_at_once_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="max_num_seqs=64") as exc:
        llm.generate([PROMPT], SamplingParams(n=65, max_tokens=2))
    assert exc.value.param == "n"
    with pytest.raises(InvalidRequestError, match="max_num_seqs=64") as exc:
        llm.generate([PROMPT], SamplingParams(n=2, best_of=65, max_tokens=2))
    assert exc.value.param == "best_of"
    _assert_idle(llm)


def test_n_past_the_documented_cap_is_refused_before_any_work():
    with pytest.raises(InvalidSamplingParamsError, match=r"^n=100000 is invalid"):
        SamplingParams(n=100000)
    with pytest.raises(InvalidSamplingParamsError, match=r"^best_of=.* is invalid"):
        SamplingParams(best_of=MAX_NUM_SEQS_PER_REQUEST + 1)
    assert SamplingParams(n=MAX_NUM_SEQS_PER_REQUEST).n == MAX_NUM_SEQS_PER_REQUEST


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"logit_bias": {10**30: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 1.0, TINY_VOCAB_SIZE: -5.0}}, "logit_bias"),
        ({"stop_token_ids": [10**30]}, "stop_token_ids"),
        ({"stop_token_ids": [2, TINY_VOCAB_SIZE]}, "stop_token_ids"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(llm, kwargs, param):
    with pytest.raises(InvalidRequestError, match=rf"^{param} names token id") as exc:
        llm.generate([PROMPT], SamplingParams(max_tokens=2, **kwargs))
    assert exc.value.param == param
    last = TINY_VOCAB_SIZE - 1
    ok = SamplingParams(max_tokens=2, logit_bias={last: 1.0}, stop_token_ids=[last])
    assert llm.generate([PROMPT], ok)[0].finished
    _assert_idle(llm)
