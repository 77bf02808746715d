"""KV store tier: TTFT of a long shared prefix, cold / local prefix hit / store hit after a restart.

Usage: pagedattn bench kvstore [--prefix-len 2048] [--backends file redis] [--dtype float32]
       [--num-blocks 256] [--max-tokens 16] [--seed 0] [--out bench_out/kvstore]

Per backend, two fresh processes share one store: the first runs the prompt cold (its blocks are
saved to the store) and again (a local prefix-cache hit), then exits; the second, started
afterwards, runs the same prompt (its prefix comes from the store). Each process warms up on an
unrelated prompt first. Greedy outputs of the three runs must be token-identical. Redis runs on a
redis-server this benchmark starts on a free loopback port and stops. Needs the engine option
``LLM(kv_store=URL)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_RESULT_MARK = "KVSTORE_RESULT "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedattn bench kvstore", description=__doc__.split("\n")[0])
    p.add_argument("--prefix-len", type=int, default=2048, help="shared prompt tokens")
    p.add_argument("--suffix-len", type=int, default=8, help="prompt tokens after the prefix")
    p.add_argument("--backends", nargs="+", default=["file", "redis"], choices=["file", "redis"])
    p.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/kvstore", help="results.json goes here")
    # Internal: one phase in a child process.
    p.add_argument("--phase", choices=["write", "read"], help=argparse.SUPPRESS)
    p.add_argument("--kv-store", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _engine_options(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "num_blocks": args.num_blocks, "kv_store": args.kv_store}


def _prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    # NOTE: ids from 100 up stay clear of the special tokens at the start of the vocabulary.
    return torch.randint(100, vocab_size, (length,), generator=gen).tolist()


def run_phase(args: argparse.Namespace) -> dict:
    """In a child process: warm up, then time the prompt once (read) or twice (write)."""
    from pagedattn import LLM, SamplingParams

    llm = LLM(args.model, **_engine_options(args))
    vocab_size = len(llm.tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    llm.generate(_prompt(vocab_size, 64, args.seed + 1), SamplingParams(max_tokens=2))
    prompt = _prompt(vocab_size, args.prefix_len + args.suffix_len, args.seed)
    runs = {}
    for name in ("cold", "local_hit") if args.phase == "write" else ("store_hit",):
        out = llm.generate(prompt, params)[0]
        runs[name] = {
            "ttft_s": out.metrics.ttft,
            "num_cached_tokens": out.num_cached_tokens,
            "token_ids": list(out.outputs[0].token_ids),
        }
    stats = dataclasses.asdict(llm.engine.get_stats())
    runs["store_stats"] = {k: v for k, v in stats.items() if "store" in k or "transfer" in k}
    # NOTE: closing the engine must flush the store writer; the read phase depends on it.
    for owner in (llm, llm.engine):
        close = getattr(owner, "close", None) or getattr(owner, "shutdown", None)
        if close is not None:
            close()
            break
    return runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis() -> tuple[subprocess.Popen, str]:
    """redis-server without persistence on a free loopback port, once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise RuntimeError(f"redis-server on port {port} did not answer PING")


def run_child(args: argparse.Namespace, phase: str, url: str) -> dict:
    argv = [sys.executable, "-m", "pagedattn.benchmarks.bench_kvstore", "--phase", phase]
    argv += ["--kv-store", url, "--prefix-len", str(args.prefix_len)]
    argv += ["--suffix-len", str(args.suffix_len), "--dtype", args.dtype]
    argv += ["--num-blocks", str(args.num_blocks), "--max-tokens", str(args.max_tokens)]
    argv += ["--seed", str(args.seed)] + (["--model", args.model] if args.model else [])
    proc = subprocess.run(argv, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            return json.loads(line.removeprefix(_RESULT_MARK))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    raise RuntimeError(
        f"{phase} phase on {url} failed (exit {proc.returncode}): " + " | ".join(tail)
    )


def run_backend(args: argparse.Namespace, backend: str) -> dict:
    redis_proc = None
    store_dir = None
    try:
        if backend == "redis":
            redis_proc, url = start_redis()
        else:
            store_dir = tempfile.mkdtemp(prefix="pagedattn-kvstore-")
            url = f"file://{store_dir}"
        runs = run_child(args, "write", url)
        runs.update(run_child(args, "read", url))
        return runs
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        if store_dir is not None:
            shutil.rmtree(store_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase is not None:
        print(_RESULT_MARK + json.dumps(run_phase(args)), flush=True)
        return 0
    results = {}
    for backend in args.backends:
        try:
            runs = run_backend(args, backend)
        except RuntimeError as error:
            if "unknown engine option(s) 'kv_store'" in str(error):
                print("this engine has no kv_store option yet: the connector is not wired in")
            else:
                print(error)
            return 1
        cold = runs["cold"]
        for name in ("cold", "local_hit", "store_hit"):
            run = runs[name]
            run["vs_cold"] = run["ttft_s"] / cold["ttft_s"]
            run["same_tokens_as_cold"] = run["token_ids"] == cold["token_ids"]
            print(
                f"{backend} {name}: TTFT {run['ttft_s'] * 1e3:.1f} ms "
                f"({run['vs_cold']:.3f}x cold), cached tokens {run['num_cached_tokens']}, "
                f"tokens identical to cold: {run['same_tokens_as_cold']}"
            )
        results[backend] = runs
    print(f"\nprefix {args.prefix_len} tokens, dtype {args.dtype}")
    print("| store | run | TTFT ms | x cold | cached tokens | same tokens |")
    print("|---|---|---|---|---|---|")
    for backend, runs in results.items():
        for name in ("cold", "local_hit", "store_hit"):
            run = runs[name]
            print(
                f"| {backend} | {name} | {run['ttft_s'] * 1e3:.1f} | {run['vs_cold']:.3f} | "
                f"{run['num_cached_tokens']} | {run['same_tokens_as_cold']} |"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
