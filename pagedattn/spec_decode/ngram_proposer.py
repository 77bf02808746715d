"""Prompt lookup: propose what followed the latest earlier match of the context's tail."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Finds the longest suffix n-gram (ngram_max down to ngram_min) seen before in the context
    and proposes the up to K tokens that followed its most recent earlier occurrence (the most
    recent one with K tokens after it, where there is one)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to num_tokens draft tokens continuing token_ids (empty when no n-gram matches)."""
        length = len(token_ids)
        if num_tokens <= 0 or length < self.ngram_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # NOTE: candidates for the shortest n-gram first (one vectorised pass), then each is
        # extended; the longest match wins, the most recent among equals.
        last = tokens[-1]
        starts = np.flatnonzero(tokens[: length - 1] == last)  # earlier positions of the last token
        if starts.size == 0:
            return []
        best_end = -1
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            ends = starts[starts >= n - 1]  # an n-gram ending at e covers e-n+1 .. e
            if ends.size == 0:
                continue
            windows = sliding_window_view(tokens[: length - 1], n)[ends - n + 1]
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                # NOTE: the latest match with K tokens after it; else the earliest (longest tail):
                # in a loop of one token the latest match is followed by a single token.
                matched = ends[hits]
                full = matched[matched + num_tokens <= length - 1]
                best_end = int(full[-1] if full.size else matched[0])
                break
        if best_end < 0:
            return []
        return tokens[best_end + 1 : best_end + 1 + num_tokens].tolist()
