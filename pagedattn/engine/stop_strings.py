"""Stop strings: the engine's stop check on detokenised text (token stops are the scheduler's)."""

from __future__ import annotations

from collections.abc import Sequence


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """The first stop string that ends in the new tail of `text`, and where to cut the text."""
    best: tuple[str, int, int] | None = None  # (stop string, start index, cut index)
    for stop_str in stop:
        # A match must end inside the new characters; it may start in the older text.
        start = max(0, len(text) - num_new_chars - len(stop_str) + 1)
        index = text.find(stop_str, start)
        if index == -1 or (best is not None and index >= best[1]):
            continue
        cut = index + len(stop_str) if include_stop_str_in_output else index
        best = (stop_str, index, cut)
    return None if best is None else (best[0], best[2])
