"""Decode-step ablation: the same batch-32 decode under each CPU optimisation switched off in turn.

    pagedattn bench decode_step [--batch 32] [--prompt-len 128] [--max-tokens 128]

Each configuration runs in a fresh process (its engine options, e.g. ``linear_kernel`` or
``decode_stack=False``, decide the kernels at load): the uniform workload's requests all join
at once, and the median wall time of the last ``--measure`` decode steps is one sample.
``--rounds`` passes run every configuration in turn, so slow spells of a shared machine hit all
of them; the table gives each one's fastest round (the least disturbed) and the slowest, next
to the default configuration's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name -> (engine options, environment overrides, what it switches off)
CONFIGS: dict[str, tuple[dict[str, object], dict[str, str], str]] = {
    "default": ({}, {}, "everything on (linear kernels: the kernel tuner's measured plan)"),
    "no_decode_stack": (
        {"decode_stack": False},
        {},
        "the compiled decode stack (decode layers run as Python modules)",
    ),
    "omp_passive": ({}, {"OMP_WAIT_POLICY": "passive"}, "OpenMP threads sleep between ops"),
    "linear_panels": ({"linear_kernel": "panels"}, {}, "the panel GEMM for every linear"),
    "linear_dpbf16": ({"linear_kernel": "dpbf16"}, {}, "bf16 panels on AVX512-BF16 dot products"),
    "linear_onednn": ({"linear_kernel": "onednn"}, {}, "oneDNN packed at load (AMX for bf16)"),
    "linear_mkl": ({"linear_kernel": "mkl"}, {}, "MKL packed GEMM (float32 only)"),
    "linear_torch": ({"linear_kernel": "torch"}, {}, "plain F.linear"),
    "attention_torch": ({"attention_kernel": "torch"}, {}, "decode attention on gather + SDPA"),
    "no_step_ops": ({"step_ops": False}, {}, "PyTorch norm/rope/SwiGLU/cache writes"),
    "kv_cache_bf16": (
        {"kv_cache_dtype": "bfloat16"},
        {},
        "(on, not off) a bf16 KV cache beside the model's dtype",
    ),
    "no_extension": (
        {},
        {"PAGEDATTN_DISABLE_CPU_EXT": "1"},
        "no compiled code: library GEMM, PyTorch attention and step ops",
    ),
}


def child(args: argparse.Namespace) -> None:
    from pagedattn import LLM, SamplingParams

    options = CONFIGS[args.config][0]
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, **options)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    vocab = engine.vocab_size
    for i in range(args.batch):
        prompt = [(i * 7919 + j * 104729) % (vocab - 200) + 100 for j in range(args.prompt_len)]
        engine.add_request(str(i), prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    decode = steps[-args.measure :]
    print(json.dumps({"median_s": statistics.median(decode), "steps": len(steps)}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--measure", type=int, default=100, help="last N decode steps timed")
    p.add_argument(
        "--configs",
        default=",".join(n for n in CONFIGS if n != "kv_cache_bf16"),
        help=", ".join(CONFIGS),
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="default", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure >= args.max_tokens:
        p.error("--measure must be below --max-tokens (the first steps are prefill)")
    if args._child:
        child(args)
        return 0
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    forwarded = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--_child"]
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            env = {**os.environ, **CONFIGS[name][1]}
            cmd = [
                sys.executable,
                "-m",
                "pagedattn.benchmarks.bench_decode_step",
                *forwarded,
                "--_child",
                "--config",
                name,
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"{name}: failed ({proc.returncode}): {proc.stderr[-400:]}", file=sys.stderr)
                continue
            step = json.loads(proc.stdout.strip().splitlines()[-1])["median_s"]
            samples[name].append(step)
            print(f"round {round_ + 1} {name:14s} {step * 1e3:7.1f} ms per decode step", flush=True)
    results = {name: min(v) for name, v in samples.items() if v}
    base = results.get("default")
    header = "configuration | what is off | decode step ms (fastest / slowest round) | vs default"
    print(f"\n| {header} | tok/s at batch {args.batch} |")
    print("|---|---|---|---|---|")
    for name, step in results.items():
        ratio = f"{step / base:.2f}x" if base else "-"
        spread = f"{step * 1e3:.1f} / {max(samples[name]) * 1e3:.1f}"
        tok_s = args.batch / step
        print(f"| {name} | {CONFIGS[name][2]} | {spread} | {ratio} | {tok_s:.0f} |")
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
