"""Markdown tables and matplotlib plots of memory simulation results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pagedattn.sim.metrics import SimResult
from pagedattn.sim.sharing import SharingResult


def _pyplot():
    """matplotlib's pyplot on the Agg backend, imported on first plot (the `viz` extra: tables
    need no matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def policy_table(results: Sequence[SimResult], baseline: SimResult | None = None) -> str:
    """One row per policy: the metrics of ``pagedattn.sim.metrics``; concurrency vs ``baseline``."""
    headers = [
        "policy",
        "utilisation",
        "reservation",
        "internal frag",
        "external frag",
        "occupancy",
        "max conc",
        "mean conc",
        "x conc vs (a)",
        "preemptions",
        "tokens/step",
    ]
    rows = []
    for r in results:
        ratio = r.mean_concurrent / baseline.mean_concurrent if baseline else float("nan")
        rows.append(
            [
                r.policy,
                _pct(r.utilization),
                _pct(r.reservation_frac),
                _pct(r.internal_frac),
                _pct(r.external_frac),
                _pct(r.occupancy),
                r.max_concurrent,
                f"{r.mean_concurrent:.1f}",
                f"{ratio:.2f}",
                r.num_preemptions,
                f"{r.tokens_per_step:.1f}",
            ]
        )
    return markdown_table(headers, rows)


def memory_breakdown(r: SimResult) -> dict[str, float]:
    """Token states, reservation, internal and external fragmentation as shares of the memory
    that is allocated or stranded (sum to 1), like the PagedAttention paper's Figure 2."""
    denom = r.occupancy + r.external_frac
    if denom == 0:
        return {"token states": 0.0, "reservation": 0.0, "internal": 0.0, "external": 0.0}
    return {
        "token states": r.utilization * r.occupancy / denom,
        "reservation": r.reservation_frac * r.occupancy / denom,
        "internal": r.internal_frac * r.occupancy / denom,
        "external": r.external_frac / denom,
    }


def plot_breakdown(results: Sequence[SimResult], title: str, path: Path) -> Path:
    """Stacked bars of memory_breakdown per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    colors = {
        "token states": "#2ca02c",
        "reservation": "#ff7f0e",
        "internal": "#d62728",
        "external": "#7f7f7f",
    }
    names = [r.policy for r in results]
    bottoms = [0.0] * len(results)
    for part, color in colors.items():
        values = [100 * memory_breakdown(r)[part] for r in results]
        ax.barh(names, values, left=bottoms, color=color, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for i, r in enumerate(results):
        ax.text(
            1,
            i,
            f"{100 * memory_breakdown(r)['token states']:.1f}%",
            va="center",
            color="white",
            fontsize=8,
        )
    ax.set_xlabel("% of KV memory allocated or stranded (time-averaged)")
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=9, pad=22)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_concurrency(results: Sequence[SimResult], title: str, path: Path) -> Path:
    """Mean and max concurrent sequences per policy."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [r.mean_concurrent for r in results], 0.4, label="mean")
    ax.bar([x + 0.2 for x in xs], [r.max_concurrent for r in results], 0.4, label="max")
    ax.set_xticks(list(xs), [r.policy for r in results], rotation=15, fontsize=8)
    ax.set_ylabel("concurrent sequences")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_block_sweep(
    block_sizes: Sequence[int],
    results: Sequence[SimResult],
    kernel_us: dict[int, float] | None,
    path: Path,
) -> Path:
    """Memory waste (1 - utilisation) vs block size, with kernel time on a second axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(block_sizes, [100 * (1 - r.utilization) for r in results], "o-", label="KV waste %")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(block_sizes), [str(b) for b in block_sizes])
    ax.set_xlabel("block size B (tokens)")
    ax.set_ylabel("waste: 1 - utilisation (%)")
    if kernel_us:
        twin = ax.twinx()
        bs = [b for b in block_sizes if b in kernel_us]
        twin.plot(bs, [kernel_us[b] for b in bs], "s--", color="#d62728", label="kernel time")
        twin.set_ylabel("attention kernel time (us)", color="#d62728")
    ax.set_title("block size: fragmentation vs kernel time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sharing(results: dict[str, list[SharingResult]], path: Path) -> Path:
    """Memory saved vs width, one line per (workload, mode)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, series in results.items():
        ax.plot([s.width for s in series], [100 * s.saving for s in series], "o-", label=label)
    widths = sorted({s.width for series in results.values() for s in series})
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("n (parallel samples) / beam width")
    ax.set_ylabel("KV memory saved vs no sharing (%)")
    ax.legend(fontsize=8)
    ax.set_title("sharing with fork + copy-on-write", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
