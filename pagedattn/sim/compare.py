"""Run one trace under every policy side by side, sweep block sizes, and film a small pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedattn.core.kv_snapshot import kv_snapshot
from pagedattn.sim.contiguous import ContiguousPolicy, PagePolicy
from pagedattn.sim.metrics import SimResult
from pagedattn.sim.model_configs import KVGeometry
from pagedattn.sim.paged import VOCAB_SIZE, random_prompts, run_paged
from pagedattn.sim.stepper import SimSchedulerConfig, run_policy
from pagedattn.sim.traces import TraceRequest, with_system_prompt

DEFAULT_PAGE_BYTES = 2 * 1024**2  # vAttention maps 2 MB physical pages (CUDA VMM granularity)


@dataclass(frozen=True)
class MemorySetup:
    """A fixed KV memory for a model: every policy of one comparison gets the same slots."""

    geometry: KVGeometry
    memory_bytes: int
    max_seq_len: int
    scheduler: SimSchedulerConfig
    page_bytes: int = DEFAULT_PAGE_BYTES

    @property
    def capacity_slots(self) -> int:
        """Tokens of KV (all layers, K and V) that fit in the memory."""
        return self.memory_bytes // self.geometry.bytes_per_token

    @property
    def vmm_page_tokens(self) -> int:
        """Tokens per physical page: vAttention maps pages per layer K (or V) buffer."""
        return max(1, self.page_bytes // self.geometry.bytes_per_token_per_layer)


def compare_policies(
    trace: list[TraceRequest], setup: MemorySetup, block_size: int
) -> list[SimResult]:
    """(a) max, (b) max_tokens, (c) exact first-fit, (d) vAttention pages, then real paging."""
    cap = setup.capacity_slots
    policies = [
        ContiguousPolicy("max", cap, setup.max_seq_len),
        ContiguousPolicy("max_tokens", cap, setup.max_seq_len),
        ContiguousPolicy("exact", cap, setup.max_seq_len),
        PagePolicy(f"vattention-{setup.page_bytes // 1024**2}MB", cap, setup.vmm_page_tokens),
    ]
    results = [run_policy(trace, p, setup.scheduler) for p in policies]
    paged = run_paged(
        trace,
        block_size=block_size,
        capacity_slots=cap,
        config=setup.scheduler,
        max_seq_len=setup.max_seq_len,
    )
    return results + [paged.result]


def sweep_block_sizes(
    trace: list[TraceRequest], setup: MemorySetup, block_sizes: Sequence[int]
) -> list[SimResult]:
    """The real paged run at each block size, same memory."""
    return [
        run_paged(
            trace,
            block_size=b,
            capacity_slots=setup.capacity_slots,
            config=setup.scheduler,
            max_seq_len=setup.max_seq_len,
        ).result
        for b in block_sizes
    ]


def film_pool(
    trace: list[TraceRequest],
    out_dir: Path,
    *,
    block_size: int = 16,
    num_blocks: int = 96,
    num_frames: int = 24,
    max_seq_len: int = 2048,
    system_prompt_len: int = 32,
) -> Path:
    """A GIF of a small pool while the trace runs through the real scheduler; every prompt
    starts with the same ``system_prompt_len`` tokens, so prefix-cache sharing shows."""
    from pagedattn.viz.block_pool_plot import save_frames, save_gif

    snapshots: list[dict] = []

    def on_step(step: int, scheduler, manager) -> None:
        snap = kv_snapshot(manager, dict(scheduler.requests))
        snap["label"] = (
            f"step {step}: {len(scheduler.running)} running, {len(scheduler.waiting)} waiting"
        )
        snapshots.append(snap)

    config = SimSchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64)
    system = np.random.default_rng(1).integers(0, VOCAB_SIZE, system_prompt_len).tolist()
    run_paged(
        with_system_prompt(trace, system_prompt_len, max_seq_len),
        block_size=block_size,
        capacity_slots=num_blocks * block_size,
        config=config,
        max_seq_len=max_seq_len,
        enable_caching=True,
        on_step=on_step,
        prompts=random_prompts(seed=2, prefix=system),
    )
    stride = max(1, len(snapshots) // num_frames)
    frames = save_frames(snapshots[::stride], out_dir / "frames")
    return save_gif(frames, out_dir / "pool.gif")
