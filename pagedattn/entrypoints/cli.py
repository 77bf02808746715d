"""The `pagedattn` command: generate, chat, serve and bench."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

from pagedattn.entrypoints.args import (
    CHAT_MAX_TOKENS,
    HelpFormatter,
    add_engine_args,
    add_sampling_args,
    add_serve_args,
    build_llm,
    sampling_params,
)

DEFAULT_PROMPTS = [
    "What is paged attention, in one sentence?",
    "Write a haiku about memory.",
    "List three uses of a hash table.",
    "Explain copy-on-write to a child.",
]


class CliError(ValueError):
    """The command line asks for something that cannot be done; the message says what to pass."""


def read_prompts(args: argparse.Namespace) -> list[str]:
    """Prompts from the arguments, else --file, else stdin, else the demo prompts."""
    if args.prompts:
        empty = [i + 1 for i, p in enumerate(args.prompts) if not p.strip()]
        if empty:
            raise CliError(
                f"prompt {empty[0]} is empty: give some text (or no prompt argument for the demo "
                "prompts, --file FILE, or prompts on stdin)"
            )
        return list(args.prompts)
    if args.file:
        lines = Path(args.file).read_text().splitlines()
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise CliError(f"--file {args.file} holds no prompt: write one prompt per line")
        return prompts
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
    prompts = read_prompts(args)
    params = sampling_params(args)
    llm = build_llm(args)
    use_chat = not args.raw and getattr(llm.tokenizer, "chat_template", None) is not None
    if use_chat:
        outs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 8
        )
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 8)
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"\n### {prompt}")
        if out.error is not None:
            print(f"    error: {out.error}")
            continue
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


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedattn import benchmarks

    try:
        benchmarks.resolve(args.name)
    except ValueError as e:
        raise CliError(str(e)) from None
    return benchmarks.run(args.name, args.bench_args)


def _bench_epilog() -> str:
    from pagedattn import benchmarks

    lines = [f"  {name:<12} {text}" for name, text in benchmarks.describe().items()]
    return "benchmarks (`pagedattn bench NAME --help` lists NAME's options):\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, formatter_class=HelpFormatter, **kwargs
        )

    gen = add("generate", "generate for prompts (arguments, --file or stdin)")
    gen.add_argument("prompts", nargs="*", help="prompts (default: a few demo prompts)")
    gen.add_argument("--file", default=None, help="one prompt per line (default: none)")
    gen.add_argument(
        "--raw", action="store_true", help="send prompts as they are, without the chat template"
    )
    # NOTE: on generate and chat, --seed seeds each request's sampling (sampling options).
    add_engine_args(gen, exclude=("seed",))
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = add("chat", "interactive chat; /fork NAME branches the conversation")
    add_engine_args(chat, exclude=("seed",))
    add_sampling_args(chat, max_tokens=CHAT_MAX_TOKENS)
    chat.set_defaults(func=cmd_chat)

    serve = add("serve", "OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark shipped in pagedattn.benchmarks",
        description="Run a benchmark shipped in pagedattn.benchmarks.",
        epilog=_bench_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", help="which benchmark (listed below)")
    bench.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        help="the benchmark's own options (`pagedattn bench NAME --help` lists them)",
    )
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from pagedattn.config import ConfigError
    from pagedattn.engine.errors import InvalidRequestError
    from pagedattn.model.loader import ModelNotFoundError
    from pagedattn.sampling_params import InvalidSamplingParamsError

    errors = (ConfigError, CliError, InvalidRequestError, InvalidSamplingParamsError)
    try:
        return args.func(args)
    except (*errors, ModelNotFoundError) as e:
        print(f"pagedattn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if argv is None:  # the process is this command, and it ends now
            # NOTE: the interpreter's exit collects every object still alive (0.3-0.4 s once
            # torch is loaded); it skips frozen ones, and the OS frees their memory anyway.
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
