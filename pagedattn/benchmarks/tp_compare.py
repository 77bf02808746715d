"""`pagedattn bench throughput --tensor-parallel-size N`: 1 rank against N ranks, side by side.

One batch of equal-length prompts (so every step after the prefill is a decode step of the whole
batch), greedy, float32 by default. Per configuration: output tokens/s, the mean decode step,
the time rank 0 spent in collectives (all-reduces, the logits gather) per decode step and its
share of the step, the time to pickle and send the step's contract, and whether the tokens equal
1 rank's. The same cores are shared out: 1 rank runs --threads threads, N ranks run
--threads / N each. N ranks run once with the shared-memory all-reduce and once with gloo's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class TPResult:
    """One configuration's numbers."""

    label: str
    tensor_parallel_size: int
    all_reduce: str
    threads_per_rank: int
    output_tok_s: float
    decode_step_ms: float
    collective_ms: float  # per decode step, on rank 0
    wait_ms: float  # of collective_ms: waiting for the last peer (shm only)
    num_collectives: float  # per decode step
    contract_ms: float  # pickling + sending the SchedulerOutput per decode step
    same_tokens: bool | None = None

    @property
    def collective_share(self) -> float:
        return self.collective_ms / self.decode_step_ms if self.decode_step_ms else 0.0


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, prompt_len), generator=g).tolist()


def run_config(args: argparse.Namespace, tp: int, all_reduce: str) -> tuple[TPResult, list]:
    """Load the model with ``tp`` ranks, run the batch; (numbers, token ids per request)."""
    from pagedattn import LLM, SamplingParams

    threads = max(1, args.threads // tp)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        tensor_parallel_size=tp,
        num_threads=threads,
        tp_all_reduce=all_reduce,
        block_size=args.block_size,
    )
    engine = llm.engine
    try:
        prompts = _prompts(args.batch, args.prompt_len, engine.vocab_size, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        t_start = time.perf_counter()
        while engine.get_stats().num_waiting or engine.scheduler.num_running < len(prompts):
            engine.step()  # the prefill steps
        runner, group = engine.runner, engine.runner.parallel
        if group is not None:
            group.reset_counters()
            runner.pickle_seconds = 0.0
        tokens: dict[str, list[int]] = {}
        num_steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
            num_steps += 1
        t_end = time.perf_counter()
        decode_ms = (t_end - t0) / max(num_steps, 1) * 1e3
        per_step = 1e3 / max(num_steps, 1)
        result = TPResult(
            label=f"TP={tp}" + (f" ({all_reduce})" if tp > 1 else ""),
            tensor_parallel_size=tp,
            all_reduce=all_reduce if tp > 1 else "-",
            threads_per_rank=threads,
            output_tok_s=len(prompts) * args.max_tokens / (t_end - t_start),
            decode_step_ms=decode_ms,
            collective_ms=0.0 if group is None else group.collective_seconds * per_step,
            wait_ms=0.0 if group is None else group.wait_seconds * per_step,
            num_collectives=0.0 if group is None else group.num_collectives / max(num_steps, 1),
            contract_ms=0.0 if group is None else runner.pickle_seconds * per_step,
        )
        return result, [tokens[f"r{i}"] for i in range(len(prompts))]
    finally:
        engine.close()


def render(results: list[TPResult], header: str) -> str:
    lines = [
        header,
        "",
        "| config | threads/rank | output tok/s | decode step ms | collectives/step | "
        "collective ms/step | share of step | of which waiting for the peer ms | "
        "contract ms/step | tokens = TP=1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        same = "-" if r.same_tokens is None else ("yes" if r.same_tokens else "no")
        lines.append(
            f"| {r.label} | {r.threads_per_rank} | {r.output_tok_s:.1f} | "
            f"{r.decode_step_ms:.1f} | {r.num_collectives:.0f} | {r.collective_ms:.2f} | "
            f"{r.collective_share:.1%} | {f'{r.wait_ms:.2f}' if r.all_reduce == 'shm' else '-'} | "
            f"{r.contract_ms:.3f} | {same} |"
        )
    return "\n".join(lines)


def machine_header(args: argparse.Namespace) -> str:
    from pagedattn.cpu.features import describe_cpu

    probe = Path("/work/shared/tools/machine-probe")
    label = describe_cpu()
    if probe.exists():
        out = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True)
        label = (out.stdout.splitlines() or [label])[0]
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    return (
        f"{label}; load average {' '.join(load)} (other jobs share this machine); model "
        f"{args.model or 'SmolLM2-135M-Instruct'} {args.dtype}; batch {args.batch} x prompt "
        f"{args.prompt_len} + {args.max_tokens} greedy tokens; {os.cpu_count()} CPUs"
    )


def run(args: argparse.Namespace) -> int:
    """The comparison `bench throughput --tensor-parallel-size N` prints."""
    n = args.tensor_parallel_size
    configs = [(1, "shm"), (n, "shm"), (n, "gloo")]
    results, ref = [], None
    for tp, kind in configs:
        result, tokens = run_config(args, tp, kind)
        if tp == 1:
            ref = tokens
        else:
            result.same_tokens = tokens == ref
        print(
            f"{result.label}: {result.output_tok_s:.1f} output tok/s, decode step "
            f"{result.decode_step_ms:.1f} ms, collectives {result.collective_ms:.2f} ms/step "
            f"({result.collective_share:.1%}; waiting for the peer {result.wait_ms:.2f}), "
            f"contract {result.contract_ms:.3f} ms/step",
            flush=True,
        )
        results.append(result)
    text = render(results, machine_header(args))
    print(text)
    if args.out is not None:
        out = args.out.with_name(args.out.stem + f"_tp{n}.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        print(f"wrote {out}")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    """The options of the TP comparison (beside bench throughput's --model/--dtype/--threads)."""
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="compare 1 rank with N ranks (this comparison only; N > 1)",
    )
    p.add_argument("--tp-batch", dest="batch", type=int, default=32, help="TP comparison: batch")
    p.add_argument("--tp-prompt-len", dest="prompt_len", type=int, default=64)
    p.add_argument("--tp-max-tokens", dest="max_tokens", type=int, default=32)
