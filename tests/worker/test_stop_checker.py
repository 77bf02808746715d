"""check_stop: EOS, stop token ids, stop strings (incl. across steps), length, min_tokens."""

from __future__ import annotations

from pagedattn.sampling_params import SamplingParams
from pagedattn.worker.stop_checker import (
    FINISH_REASON_LENGTH,
    FINISH_REASON_STOP,
    StopResult,
    check_stop,
)

EOS = 50


def _step(tokens: list[int], text: str, params: SamplingParams, num_new: int, max_tokens=100):
    return check_stop(tokens, text, params, {EOS}, max_tokens, num_new_chars=num_new)


def test_running_request_is_not_stopped() -> None:
    assert _step([5, 6], "hello", SamplingParams(), 2) == StopResult(None, None, "hello")


def test_eos_stops_and_drops_its_text() -> None:
    res = _step([5, EOS], "hi</s>", SamplingParams(), 4)
    assert res == StopResult(FINISH_REASON_STOP, None, "hi")
    kept = _step([5, EOS], "hi</s>", SamplingParams(include_stop_str_in_output=True), 4)
    assert kept.text == "hi</s>"


def test_ignore_eos_goes_on() -> None:
    assert _step([5, EOS], "hi", SamplingParams(ignore_eos=True), 0).finish_reason is None


def test_stop_token_id_sets_stop_reason() -> None:
    res = _step([5, 9], "ab.", SamplingParams(stop_token_ids=[9]), 1)
    assert res == StopResult(FINISH_REASON_STOP, 9, "ab")


def test_stop_string_truncates_text() -> None:
    params = SamplingParams(stop=["\n\n", "END"])
    res = _step([1, 2, 3], "first line\n\nsecond", params, 12)
    assert res == StopResult(FINISH_REASON_STOP, "\n\n", "first line")
    incl = SamplingParams(stop=["END"], include_stop_str_in_output=True)
    assert _step([1], "abcENDxyz", incl, 9) == StopResult(FINISH_REASON_STOP, "END", "abcEND")


def test_earliest_stop_string_wins() -> None:
    res = _step([1], "a STOP b HALT", SamplingParams(stop=["HALT", "STOP"]), 13)
    assert res == StopResult(FINISH_REASON_STOP, "STOP", "a ")


def test_stop_string_spanning_two_steps() -> None:
    params = SamplingParams(stop=["world"])
    first = _step([4, 5], "hello wor", params, 3)
    assert first.finish_reason is None
    second = _step([4, 5, 6], "hello world!", params, 3)
    assert second == StopResult(FINISH_REASON_STOP, "world", "hello ")


def test_stop_string_only_searched_in_new_tail() -> None:
    # "END" lies entirely in text of earlier steps: it was not a stop there (e.g. min_tokens).
    params = SamplingParams(stop=["END"])
    assert _step([1, 2, 3], "xxEND and more", params, 5).finish_reason is None
    assert _step([1, 2, 3], "xxEND and more", params, 12).stop_reason == "END"


def test_length() -> None:
    res = _step([1, 2, 3], "abc", SamplingParams(max_tokens=3), 1, max_tokens=3)
    assert res == StopResult(FINISH_REASON_LENGTH, None, "abc")
    # A stop on the last allowed token reports "stop".
    res = _step([1, 2, EOS], "ab", SamplingParams(max_tokens=3), 0, max_tokens=3)
    assert res.finish_reason == FINISH_REASON_STOP


def test_min_tokens_blocks_early_stops_but_not_length() -> None:
    params = SamplingParams(min_tokens=3, stop=["x"], stop_token_ids=[9])
    assert _step([EOS], "", params, 0).finish_reason is None
    assert _step([1, 9], "a", params, 1).finish_reason is None
    assert _step([1, 4], "ax", params, 1).finish_reason is None
    assert _step([1, 4, 9], "ab", params, 1).stop_reason == 9
    assert _step([1, 4], "ab", params, 1, max_tokens=2).finish_reason == FINISH_REASON_LENGTH


def test_default_num_new_chars_searches_whole_text() -> None:
    res = check_stop([1], "abc###def", SamplingParams(stop="###"), {EOS}, 10)
    assert res == StopResult(FINISH_REASON_STOP, "###", "abc")
