"""find_stop_string: the engine's stop check on detokenised text (token stops: the scheduler's)."""

from __future__ import annotations

from pagedattn.engine.stop_strings import find_stop_string


def test_stop_string_cuts_the_text_before_it_or_after_it() -> None:
    assert find_stop_string("first line\n\nsecond", 12, ["\n\n", "END"], False) == ("\n\n", 10)
    assert find_stop_string("abcENDxyz", 9, ["END"], True) == ("END", 6)


def test_earliest_stop_string_wins() -> None:
    assert find_stop_string("a STOP b HALT", 13, ["HALT", "STOP"], False) == ("STOP", 2)


def test_stop_string_spanning_two_steps() -> None:
    assert find_stop_string("hello wor", 3, ["world"], False) is None
    assert find_stop_string("hello world!", 3, ["world"], False) == ("world", 6)


def test_stop_string_only_searched_in_new_tail() -> None:
    # "END" lies entirely in text of earlier steps: it was not a stop there (e.g. min_tokens).
    assert find_stop_string("xxEND and more", 5, ["END"], False) is None
    assert find_stop_string("xxEND and more", 12, ["END"], False) == ("END", 2)
