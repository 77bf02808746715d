"""KV memory saved by sharing blocks: parallel sampling, beam search and a shared system prompt.

Saving is measured against private copies at the same progress: at each step, ``used`` is the
number of blocks held by at least one sequence (a shared block counts once) and ``private`` is
the sum of every sequence's block-table length (what the sequences would hold without sharing);
the saving is ``1 - sum used / sum private`` over all steps. Parallel sampling and beam search
drive the real KVCacheManager's fork and copy-on-write directly, one request group at a time
(groups never share blocks with each other, so running them concurrently without preemption
gives the same sums); the system-prompt case replays the trace through the real scheduler with
prefix caching on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from pagedattn.core.request import Request
from pagedattn.sim.contiguous import SimAllocationError
from pagedattn.sim.paged import VOCAB_SIZE, random_prompts, run_paged
from pagedattn.sim.stepper import SimSchedulerConfig
from pagedattn.sim.traces import TraceRequest, with_system_prompt

# Beam search parent choice: beam of rank i (0 = best) is picked as a parent with weight RHO^i.
BEAM_PARENT_DECAY = 0.5


@dataclass(frozen=True)
class SharingResult:
    """Blocks with sharing vs private copies, summed over steps."""

    mode: str
    width: int
    used_block_steps: int
    private_block_steps: int
    num_block_copies: int
    prefix_hit_rate: float = 0.0

    @property
    def saving(self) -> float:
        """Fraction of KV memory sharing saves: 1 - sum used / sum private."""
        return 1.0 - self.used_block_steps / max(self.private_block_steps, 1)


class _GroupRunner:
    """Steps one group of sequences on a real manager and tallies used vs private blocks."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.manager = KVCacheManager(
            [KVCacheGroupSpec(("sim",), FullAttentionSpec(block_size))],
            num_blocks,
            enable_caching=False,
        )
        self.used = self.private = self.copies = 0
        self._next_id = 0

    def new_id(self) -> str:
        self._next_id += 1
        return f"seq-{self._next_id}"

    def compute(self, seq: Request, num_tokens: int) -> None:
        """Allocate (with copy-on-write) and mark ``num_tokens`` more tokens computed."""
        if self.manager.allocate_slots(seq, num_tokens) is None:
            raise SimAllocationError("the sharing simulation ran out of blocks: raise num_blocks")
        seq.num_computed_tokens += num_tokens

    def record(self, seqs: list[Request]) -> None:
        manager = self.manager
        self.used += manager.num_usable_blocks - manager.num_free_blocks
        self.private += sum(len(manager.get_block_ids(s.request_id)[0]) for s in seqs)
        self.copies += len(manager.take_block_copies())

    def fork(self, parent: Request, token: int) -> Request:
        child = parent.fork(self.new_id())
        self.manager.fork(parent, child)
        child.append_output_token_ids(token)
        return child

    def prefill(self, req: TraceRequest, rng: np.random.Generator) -> Request:
        seq = Request(self.new_id(), rng.integers(0, VOCAB_SIZE, req.prompt_len).tolist())
        self.compute(seq, req.prompt_len)
        return seq

    def check_drained(self) -> None:
        if self.manager.num_free_blocks != self.manager.num_usable_blocks or self.manager.requests:
            raise SimAllocationError("a sharing group leaked blocks")


def _blocks_for(trace: list[TraceRequest], width: int, block_size: int) -> int:
    longest = max(r.prompt_len + r.output_len for r in trace)
    return width * (-(-longest // block_size) + 2) + 8


def simulate_parallel_sampling(
    trace: list[TraceRequest], n: int, block_size: int, seed: int = 0
) -> SharingResult:
    """n samples per prompt: the prompt's blocks are forked; each sample decodes on its own.

    Sample j of request i generates ``trace[(i + j) % len(trace)].output_len`` tokens (capped at
    the request's max_tokens), so sample lengths follow the workload's distribution.
    """
    rng = np.random.default_rng(seed)
    runner = _GroupRunner(block_size, _blocks_for(trace, n, block_size))
    for i, req in enumerate(trace):
        parent = runner.prefill(req, rng)
        seqs = [runner.fork(parent, int(rng.integers(VOCAB_SIZE))) for _ in range(n)]
        runner.manager.free(parent)
        lengths = [min(trace[(i + j) % len(trace)].output_len, req.max_tokens) for j in range(n)]
        remaining = dict(zip([s.request_id for s in seqs], lengths, strict=True))
        runner.record(seqs)  # the prefill step; each sample holds its first token
        while True:
            for seq in [s for s in seqs if s.num_output_tokens >= remaining[s.request_id]]:
                runner.manager.free(seq)
                seqs.remove(seq)
            if not seqs:
                break
            for seq in seqs:
                runner.compute(seq, 1)
            runner.record(seqs)
            for seq in seqs:
                seq.append_output_token_ids(int(rng.integers(VOCAB_SIZE)))
        runner.check_drained()
    return SharingResult("parallel", n, runner.used, runner.private, runner.copies)


def simulate_beam_search(
    trace: list[TraceRequest], width: int, block_size: int, seed: int = 0
) -> SharingResult:
    """Beam search as in the PagedAttention paper: each step's ``width`` candidates fork from
    parent beams (rank i picked with weight BEAM_PARENT_DECAY^i); unpicked beams are freed. All
    beams of a request run for its output_len steps."""
    rng = np.random.default_rng(seed)
    weights = BEAM_PARENT_DECAY ** np.arange(width)
    weights /= weights.sum()
    runner = _GroupRunner(block_size, _blocks_for(trace, width, block_size))
    for req in trace:
        root = runner.prefill(req, rng)
        beams = [runner.fork(root, int(rng.integers(VOCAB_SIZE))) for _ in range(width)]
        runner.manager.free(root)
        runner.record(beams)
        for _ in range(req.output_len - 1):
            for beam in beams:
                runner.compute(beam, 1)
            runner.record(beams)
            parents = np.sort(rng.choice(width, size=width, p=weights))
            new_beams = [runner.fork(beams[p], int(rng.integers(VOCAB_SIZE))) for p in parents]
            for beam in beams:
                runner.manager.free(beam)
            beams = new_beams
        for beam in beams:
            runner.manager.free(beam)
        runner.check_drained()
    return SharingResult("beam", width, runner.used, runner.private, runner.copies)


def simulate_system_prompt(
    trace: list[TraceRequest],
    system_prompt_len: int,
    *,
    block_size: int,
    capacity_slots: int,
    config: SimSchedulerConfig,
    max_seq_len: int,
    seed: int = 0,
) -> SharingResult:
    """Every prompt starts with the same ``system_prompt_len`` tokens; prefix caching shares them.

    The trace's prompt lengths are the user parts; the hit rate is prefix-cache hit tokens over
    queried tokens, as counted by the manager.
    """
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB_SIZE, system_prompt_len).tolist()
    shifted = with_system_prompt(trace, system_prompt_len, max_seq_len)
    tally = {"used": 0, "private": 0}

    def on_step(step: int, scheduler, manager: KVCacheManager) -> None:
        tally["used"] += manager.num_usable_blocks - manager.num_free_blocks
        tally["private"] += sum(len(manager.get_block_ids(r)[0]) for r in manager.requests)

    run = run_paged(
        shifted,
        block_size=block_size,
        capacity_slots=capacity_slots,
        config=config,
        max_seq_len=max_seq_len,
        enable_caching=True,
        prompts=random_prompts(seed + 1, prefix=system),
        on_step=on_step,
    )
    stats = run.kv_cache_manager.make_stats(reset=False)
    return SharingResult(
        "system_prompt",
        system_prompt_len,
        tally["used"],
        tally["private"],
        0,
        prefix_hit_rate=stats.prefix_cache_hit_rate,
    )
