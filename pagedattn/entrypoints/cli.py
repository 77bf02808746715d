"""The `pagedattn` command: generate, chat, serve and bench."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

DEFAULT_PROMPTS = [
    "What is paged attention, in one sentence?",
    "Write a haiku about memory.",
    "List three uses of a hash table.",
    "Explain copy-on-write to a child.",
]

_BENCHMARKS = {
    "allocator": "bench_allocator",
    "attention": "bench_attention",
    "memory": "bench_memory",
    "throughput": "bench_throughput",
    "serve": "bench_serving",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: SmolLM2-135M)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides memory)")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache bytes, e.g. 2GiB")
    g.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=0.2,
        help="without --kv-cache-memory/--num-blocks: this share of free memory (default 0.2)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="KV cache dtype (auto: the model's); bfloat16 beside a float32 model halves the "
        "cache and runs attention in bf16 (cpu backend)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--attn-backend", default=None, help="torch, cpu or triton")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from parsed engine options."""
    return dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_chunked_prefill=not args.no_chunked_prefill,
        policy=args.policy,
        attn_backend=args.attn_backend,
        num_threads=args.threads,
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("-n", type=int, default=1, help="sequences per prompt (share prompt blocks)")


def _sampling_params(args: argparse.Namespace):
    from pagedattn.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        n=args.n,
    )


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    if args.file:
        lines = Path(args.file).read_text().splitlines()
        return [line for line in lines if line.strip()]
    if not sys.stdin.isatty():
        data = sys.stdin.read()
        lines = [line for line in data.splitlines() if line.strip()]
        if lines:
            return lines
    return list(DEFAULT_PROMPTS)


def print_kv_summary(llm) -> None:
    """The end-of-run KV cache report."""
    s = llm.get_stats()
    t = s.step_times
    print(
        f"\n[kv] {llm.engine.kv_summary}\n"
        f"[kv] prefix cache: {s.prefix_cache_hits}/{s.prefix_cache_queries} prompt tokens hit "
        f"({100 * s.prefix_cache_hit_rate:.1f}%); preemptions {s.num_preemptions}; recomputed "
        f"tokens {s.num_recomputed_tokens}; blocks free {s.num_free_blocks}/{s.num_blocks} "
        f"(cached {s.num_cached_blocks})\n"
        f"[kv] tokens: {s.num_prompt_tokens} prompt, {s.num_generation_tokens} generated in "
        f"{t.num_steps} steps; time: schedule {t.schedule:.3f}s, prepare {t.prepare:.3f}s, "
        f"forward {t.forward:.3f}s, sample {t.sample:.3f}s, output {t.process:.3f}s"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedattn import LLM

    prompts = _read_prompts(args)
    params = _sampling_params(args)
    llm = LLM(**engine_kwargs(args), verbose=True)
    use_chat = not args.raw and getattr(llm.tokenizer, "chat_template", None) is not None
    if use_chat:
        outs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 8
        )
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 8)
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"\n### {prompt}")
        for c in out.outputs:
            tag = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{c.text.strip()}  ({len(c.token_ids)} tokens, {c.finish_reason})")
        m = out.metrics
        print(f"    ttft {1000 * (m.ttft or 0):.0f} ms, cached prompt tokens {m.num_cached_tokens}")
    print_kv_summary(llm)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedattn.entrypoints.chat import run_chat

    return run_chat(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedattn.entrypoints.openai.server import run_server

    return run_server(args) or 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    sys.argv = [f"pagedattn bench {args.which}", *rest]
    runpy.run_module(f"pagedattn.benchmarks.{_BENCHMARKS[args.which]}", run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate for prompts (arguments, --file or stdin)")
    gen.add_argument("prompts", nargs="*", help="prompts (default: a few demo prompts)")
    gen.add_argument("--file", default=None, help="one prompt per line")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat; /fork branches the conversation")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat, max_tokens=256)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from pagedattn.entrypoints.openai.server import add_serve_args

        add_serve_args(serve)
    except ImportError:
        add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(_BENCHMARKS))
    bench.add_argument("which", choices=sorted(_BENCHMARKS))
    bench.set_defaults(func=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from pagedattn.config import ConfigError
    from pagedattn.engine.errors import InvalidRequestError
    from pagedattn.model.loader import ModelNotFoundError
    from pagedattn.sampling_params import InvalidSamplingParamsError

    try:
        return args.func(args)
    except (ConfigError, InvalidRequestError, InvalidSamplingParamsError, ModelNotFoundError) as e:
        print(f"pagedattn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
