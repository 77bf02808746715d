"""Draw a kv_snapshot(): one cell per block coloured by state, plus selected block tables."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from PIL import Image  # noqa: E402

FREE_RGB = (0.93, 0.93, 0.93)
CACHED_RGB = (0.72, 0.83, 0.93)  # free, but its hash still serves prefix-cache hits
NULL_RGB = (0.25, 0.25, 0.25)
SHARED_RGB = (0.55, 0.0, 0.35)  # held by more than one request; darker with more sharers
MAX_TABLE_ROWS = 6
MAX_TABLE_COLS = 48
# Saturated colours only (no greys, no pale tints), so no request looks free or cached.
_REQUEST_PALETTE = [
    tuple(c[:3])
    for name in ("tab10", "Dark2", "Set1")
    for c in plt.get_cmap(name).colors
    if len(set(c[:3])) > 1 and min(c[:3]) < 0.6
]


def request_color(request_id: str) -> tuple[float, float, float]:
    """A stable colour per request id (same id, same colour in every frame)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=2).digest()
    return _REQUEST_PALETTE[int.from_bytes(digest, "big") % len(_REQUEST_PALETTE)]


def block_colors(snapshot: dict) -> np.ndarray:
    """[num_blocks, 3] RGB per block from its state."""
    colors = np.empty((snapshot["num_blocks"], 3))
    for i, (state, owners, ref_cnt) in enumerate(
        zip(snapshot["state"], snapshot["owners"], snapshot["ref_cnt"], strict=True)
    ):
        if state == "free":
            colors[i] = FREE_RGB
        elif state == "cached":
            colors[i] = CACHED_RGB
        elif state == "null":
            colors[i] = NULL_RGB
        elif state == "owned" and owners:
            colors[i] = request_color(owners[0])
        else:  # shared
            shade = max(0.45, 1.0 - 0.1 * (ref_cnt - 2))
            colors[i] = tuple(c * shade for c in SHARED_RGB)
    return colors


def _draw_grid(ax: plt.Axes, snapshot: dict, num_cols: int) -> None:
    num_blocks = snapshot["num_blocks"]
    num_rows = math.ceil(num_blocks / num_cols)
    grid = np.ones((num_rows * num_cols, 3))
    grid[:num_blocks] = block_colors(snapshot)
    ax.imshow(grid.reshape(num_rows, num_cols, 3), interpolation="nearest", aspect="equal")
    ax.set_xticks(np.arange(-0.5, num_cols, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, num_rows, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
    if num_blocks <= 256:
        for i, ref_cnt in enumerate(snapshot["ref_cnt"]):
            if ref_cnt >= 2:
                ax.text(
                    i % num_cols,
                    i // num_cols,
                    str(ref_cnt),
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=6,
                )
    stats = snapshot["stats"]
    ax.set_title(
        f"{num_blocks} blocks x {snapshot['block_size']} tokens: {stats['num_used_blocks']} used, "
        f"{stats['num_shared_blocks']} shared, {stats['num_cached_free_blocks']} cached-free, "
        f"{stats['num_free_blocks']} free",
        fontsize=8,
    )


def _draw_tables(ax: plt.Axes, snapshot: dict, request_ids: Sequence[str]) -> None:
    """One row per request: its block table as coloured cells labelled with block ids."""
    ax.set_axis_off()
    ref_cnt = snapshot["ref_cnt"]
    tables = [[b for g in snapshot["block_tables"][r] for b in g] for r in request_ids]
    num_cols = max(16, min(max(map(len, tables), default=0), MAX_TABLE_COLS))
    image = np.ones((max(len(tables), 1), num_cols, 3))  # [rows, cols, rgb], white = no entry
    for row, (req_id, table) in enumerate(zip(request_ids, tables, strict=True)):
        ax.text(-0.8, row, req_id, ha="right", va="center", fontsize=7)
        for col, block_id in enumerate(table[:num_cols]):
            image[row, col] = SHARED_RGB if ref_cnt[block_id] >= 2 else request_color(req_id)
            ax.text(col, row, str(block_id), ha="center", va="center", fontsize=5, color="white")
    ax.imshow(image, interpolation="nearest", aspect="auto")
    ax.vlines(np.arange(0.5, num_cols), -0.5, len(tables) - 0.5, color="white", linewidth=1)
    ax.hlines(np.arange(0.5, len(tables)), -0.5, num_cols - 0.5, color="white", linewidth=2)
    ax.set_xlim(-0.5 - num_cols / 6, num_cols - 0.5)
    ax.set_title("block tables (logical block j -> physical block id)", fontsize=8)


def render_snapshot(
    snapshot: dict, *, request_ids: Sequence[str] | None = None, title: str | None = None
) -> Figure:
    """A figure of the pool (and the block tables of ``request_ids``, default: the first few)."""
    if request_ids is None:
        request_ids = sorted(snapshot["block_tables"])[:MAX_TABLE_ROWS]
    num_cols = max(8, math.ceil(math.sqrt(snapshot["num_blocks"] * 2)))
    fig, (grid_ax, table_ax) = plt.subplots(
        2, 1, figsize=(8, 7), gridspec_kw={"height_ratios": [3, 1]}
    )
    _draw_grid(grid_ax, snapshot, num_cols)
    _draw_tables(table_ax, snapshot, list(request_ids))
    legend = [
        Patch(color=FREE_RGB, label="free"),
        Patch(color=CACHED_RGB, label="free, cached"),
        Patch(color=SHARED_RGB, label="shared (k = ref_cnt)"),
        Patch(color=_REQUEST_PALETTE[0], label="owned (colour = request)"),
    ]
    grid_ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.01),
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    if title:
        fig.suptitle(title, fontsize=10)
    # NOTE: fixed margins: tight_layout costs more than the drawing itself.
    fig.subplots_adjust(left=0.03, right=0.97, top=0.9, bottom=0.03, hspace=0.25)
    return fig


def save_frames(snapshots: Sequence[dict], out_dir: str | Path, prefix: str = "pool") -> list[Path]:
    """One PNG per snapshot, named ``{prefix}_{i:04d}.png``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, snap in enumerate(snapshots):
        fig = render_snapshot(snap, title=snap.get("label", f"step {i}"))
        path = out / f"{prefix}_{i:04d}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def save_gif(frames: Sequence[Path], path: str | Path, frame_ms: int = 400) -> Path:
    """Join PNG frames into an animated GIF."""
    if not frames:
        raise ValueError("save_gif needs at least one frame")
    images = [Image.open(p).convert("P", palette=Image.Palette.ADAPTIVE) for p in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=frame_ms, loop=0)
    return Path(path)
