"""The pool renderer: colours by state, PNG frames, an animated GIF from a real replay."""

from __future__ import annotations

import numpy as np
from PIL import Image

from pagedattn.core.kv_snapshot import build_snapshot
from pagedattn.sim.compare import film_pool
from pagedattn.sim.traces import generate_trace
from pagedattn.viz.block_pool_plot import (
    CACHED_RGB,
    FREE_RGB,
    SHARED_RGB,
    block_colors,
    request_color,
    save_frames,
    save_gif,
)


def _snapshot() -> dict:
    # block 0 shared by a and b, 1 owned by a, 2 owned by b, 3 cached, 4 free
    return build_snapshot(
        16, [2, 1, 1, 0, 0], [True, True, False, True, False], {"a": [[0, 1]], "b": [[0, 2]]}
    )


def test_block_colors_by_state() -> None:
    colors = block_colors(_snapshot())
    assert np.allclose(colors[0], SHARED_RGB)
    assert np.allclose(colors[1], request_color("a"))
    assert np.allclose(colors[2], request_color("b"))
    assert np.allclose(colors[3], CACHED_RGB) and np.allclose(colors[4], FREE_RGB)
    assert request_color("a") == request_color("a")
    assert len({request_color(f"req-{i}") for i in range(40)}) > 10


def test_frames_and_gif(tmp_path) -> None:
    snaps = [_snapshot(), build_snapshot(16, [0] * 5, [False] * 5, {})]
    frames = save_frames(snaps, tmp_path)
    assert [p.name for p in frames] == ["pool_0000.png", "pool_0001.png"]

    def count(path, rgb) -> int:
        pixels = np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3) / 255.0
        return int(np.all(np.abs(pixels - rgb) < 0.02, axis=1).sum())

    # Both frames carry the same legend; only the first draws shared and owned cells.
    assert count(frames[0], SHARED_RGB) > count(frames[1], SHARED_RGB) + 100
    assert count(frames[0], request_color("b")) > count(frames[1], request_color("b")) + 100
    gif = Image.open(save_gif(frames, tmp_path / "pool.gif"))
    assert gif.n_frames == 2


def test_film_of_a_real_replay(tmp_path) -> None:
    gif = film_pool(generate_trace("alpaca", 10, seed=0), tmp_path, num_blocks=48, num_frames=4)
    frames = sorted((tmp_path / "frames").glob("*.png"))
    assert 4 <= len(frames) <= 8
    assert Image.open(gif).n_frames == len(frames)
