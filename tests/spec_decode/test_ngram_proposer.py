"""Prompt lookup: the longest suffix n-gram, its most recent match, K tokens after it."""

from __future__ import annotations

import pytest

from pagedattn.spec_decode.ngram_proposer import NgramProposer


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # "1 2 3" occurred at the start (followed by 10 11); "3" alone recurs later (followed by 20).
    tokens = [1, 2, 3, 10, 11, 12, 3, 20, 21, 22, 1, 2, 3]
    assert NgramProposer(1, 3).propose(tokens, 2) == [10, 11]
    assert NgramProposer(1, 1).propose(tokens, 2) == [20, 21]


def test_most_recent_match_with_k_tokens_after_it():
    tokens = [7, 8, 1, 7, 8, 2, 5, 5, 7, 8]
    assert NgramProposer(2, 2).propose(tokens, 2) == [2, 5]
    # A loop of one token: the latest match has one token after it; the earliest has K.
    assert NgramProposer(2, 3).propose([4, 9, 9, 9, 9, 9, 9, 9], 3) == [9, 9, 9]


def test_no_match_and_limits():
    proposer = NgramProposer(2, 4)
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([1, 2], 3) == []
    assert proposer.propose([1, 2, 1, 2], 0) == []
    assert proposer.propose([1, 2, 5, 1, 2], 8) == [5, 1, 2]  # the context ends first
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
