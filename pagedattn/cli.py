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
from pagedattn.entrypoints.cli_checks import CliError, check_before_load

DEFAULT_PROMPTS = [
    "What is paged attention, in one sentence?",
    "Write a haiku about memory.",
    "List three uses of a hash table.",
    "Explain copy-on-write to a child.",
]


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (argparse prints the whole usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


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
        try:
            lines = Path(args.file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise CliError(f"cannot read --file {args.file}: {reason}") from None
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


def kv_summary_lines(s) -> list[str]:
    """The end-of-run KV cache report of EngineStats `s`: each count named once, in one unit."""
    t = s.step_times
    store = s.kv_store
    num_store = getattr(store, "num_hit_tokens", 0) if store is not None else 0
    num_total = s.prefix_cache_hits + num_store + s.num_prompt_tokens
    lines = [
        f"[kv] prompt tokens: {num_total} = {s.prefix_cache_hits} from the prefix cache "
        f"+ {num_store} from the KV store + {s.num_prompt_tokens} computed; "
        f"{s.num_generation_tokens} generated in {t.num_steps} steps",
        f"[kv] prefix cache: {s.prefix_cache_hits}/{s.prefix_cache_queries} looked-up prompt "
        f"tokens hit ({100 * s.prefix_cache_hit_rate:.1f}%); blocks: {s.num_free_blocks} of "
        f"{s.num_blocks} free ({s.num_cached_blocks} of those hold cached prefixes); "
        f"preemptions {s.num_preemptions}, recomputed tokens {s.num_recomputed_tokens}",
    ]
    if store is not None:
        lines.append(
            f"[kv] KV store: {num_store} prompt tokens loaded ({100 * store.hit_rate:.1f}% of "
            f"those looked up), {store.num_loaded_blocks} blocks read, {store.num_saved_blocks} "
            f"saved, {store.num_load_failures} failed loads"
        )
    spec = getattr(s, "spec_decode", None)
    if spec is not None:
        lines.append(
            f"[spec] {spec.num_accepted_tokens}/{spec.num_draft_tokens} draft tokens accepted "
            f"({100 * spec.acceptance_rate:.1f}%) in {spec.num_drafts} drafts; mean accepted "
            f"length {spec.mean_accepted_length:.2f} tokens per step; off by batch size in "
            f"{spec.num_steps_off} steps"
        )
    lines.append(
        f"[kv] time: schedule {t.schedule:.3f}s, prepare {t.prepare:.3f}s, forward "
        f"{t.forward:.3f}s, sample {t.sample:.3f}s, output {t.process:.3f}s"
    )
    return lines


def print_kv_summary(llm) -> None:
    """The end-of-run KV cache report (the cache's size was printed when it was allocated)."""
    print("\n" + "\n".join(kv_summary_lines(llm.get_stats())))


def stream_outputs(llm, prompts: list, params, labels: list[str], out=None) -> list:
    """Run every prompt as one batch, printing each one's text as it is produced, in order.

    The first unfinished prompt streams; the next one's text so far is printed when it finishes.
    Ctrl-C keeps everything printed so far. With n > 1 a prompt's choices print when it ends.
    """
    out = out or sys.stdout
    engine = llm.engine
    ids = [f"cli-{i}" for i in range(len(prompts))]
    added = []
    try:
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
            added.append(rid)
    except Exception:
        engine.abort_request(added)
        raise
    latest: dict = {}
    head = 0
    num_printed = 0
    stream = params.n == 1
    print(f"\n### {labels[0]}", file=out, flush=True)
    try:
        while head < len(ids):
            for o in engine.step():
                latest[o.request_id] = o
            while head < len(ids):
                o = latest.get(ids[head])
                if o is None:
                    break
                if stream and o.error is None:
                    text = o.outputs[0].text
                    out.write(text[num_printed:])
                    num_printed = len(text)
                    out.flush()
                if not o.finished:
                    break
                _print_finished(o, stream, out)
                head += 1
                num_printed = 0
                if head < len(ids):
                    print(f"\n### {labels[head]}", file=out, flush=True)
    except BaseException:
        engine.abort_request([r for r in ids if r not in latest or not latest[r].finished])
        raise
    return [latest[r] for r in ids]


def _print_finished(o, streamed: bool, out) -> None:
    if o.error is not None:
        print(f"    error: {o.error}", file=out)
        return
    for c in o.outputs:
        if streamed:
            print(f"  ({len(c.token_ids)} tokens, {c.finish_reason})", file=out)
        else:
            tag = f"[{c.index}] " if len(o.outputs) > 1 else ""
            print(
                f"{tag}{c.text.strip()}  ({len(c.token_ids)} tokens, {c.finish_reason})", file=out
            )
    m = o.metrics
    print(
        f"    ttft {1000 * (m.ttft or 0):.0f} ms, cached prompt tokens {m.num_cached_tokens}",
        file=out,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    params = sampling_params(args)
    check_before_load(args)
    llm = build_llm(args)
    inputs: list = list(prompts)
    has_template = getattr(llm.tokenizer, "chat_template", None) is not None
    if not args.raw and not has_template:
        # NOTE: as vLLM's LLM.generate, a model without a chat template gets the prompts as
        # they are (`chat` needs a template and refuses); said once, not silently.
        print(
            f"pagedattn: note: {llm.engine.model_name} has no chat template: the prompts are "
            "sent as they are (as --raw)",
            file=sys.stderr,
        )
    if not args.raw and has_template:
        # NOTE: as LLM.chat renders it: the template holds the special tokens already.
        texts = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        inputs = [llm.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    stream_outputs(llm, inputs, params, prompts)
    print_kv_summary(llm)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedattn.entrypoints.chat import run_chat

    check_before_load(args)
    return run_chat(args)


def cmd_serve(args: argparse.Namespace) -> int:
    """One engine behind the OpenAI server, or N replicas behind the Ray Serve ingress."""
    from pagedattn.config import EngineConfig
    from pagedattn.entrypoints.serve_config import ServeConfig

    check_before_load(args)
    engine_config, serve_config = EngineConfig.from_cli(args), ServeConfig.from_cli(args)
    if serve_config.uses_replicas:
        from pagedattn.serve.launch import run_replicas

        return run_replicas(engine_config, serve_config) or 0
    from pagedattn.entrypoints.openai.server import run_server

    return run_server(engine_config, serve_config) or 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedattn import benchmarks

    try:
        benchmarks.resolve(args.name)
    except ValueError as e:
        raise CliError(str(e)) from None
    return benchmarks.run(args.name, args.bench_args)


def cmd_env(args: argparse.Namespace) -> int:
    """The CPU as this process sees it, its ISA levels, and every environment variable."""
    from pagedattn import envs
    from pagedattn.cpu import features

    print(f"cpu: {features.describe_cpu()}")
    print(
        f"vector ISA: {features.vector_isa()} (levels this CPU runs: "
        f"{', '.join(features.isa_levels())}; PAGEDATTN_CPU_ISA caps it)"
    )
    print(f"auto dtype: {str(features.resolve_dtype('auto')).removeprefix('torch.')}")
    print("environment variables:")
    for name, value, doc in envs.describe():
        print(f"  {name}={value}\n      {doc}")
    return 0


def _bench_epilog() -> str:
    from pagedattn import benchmarks

    lines = [f"  {name:<12} {text}" for name, text in benchmarks.describe().items()]
    return "benchmarks (`pagedattn bench NAME --help` lists NAME's options):\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pagedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, **kwargs) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, formatter_class=HelpFormatter, **kwargs
        )

    gen = add("generate", "generate for prompts (arguments, --file or stdin)")
    gen.add_argument("prompts", nargs="*", help="prompts (default: a few demo prompts)")
    gen.add_argument("--file", default=None, help="one prompt per line (default: none)")
    gen.add_argument(
        "--raw",
        action="store_true",
        help="send prompts as they are, without the chat template (a model without one gets "
        "them so anyway, with a note on stderr)",
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

    env = add("env", "the CPU, its ISA levels and every PAGEDATTN_* environment variable")
    env.set_defaults(func=cmd_env)

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
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        # NOTE: imported inside the try: Ctrl-C while torch loads must not print a traceback.
        from pagedattn.config import ConfigError
        from pagedattn.cpu.plan import KernelChoiceError
        from pagedattn.engine.errors import InvalidRequestError
        from pagedattn.model.loader import ModelNotFoundError
        from pagedattn.sampling_params import InvalidSamplingParamsError

        errors = (
            ConfigError,
            CliError,
            InvalidRequestError,
            InvalidSamplingParamsError,
            KernelChoiceError,
        )
        try:
            return args.func(args)
        except (*errors, ModelNotFoundError) as e:
            print(f"pagedattn: error: {e}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        print("\npagedattn: interrupted", file=sys.stderr)
        if argv is None:
            # NOTE: CPython 3.11 marks a KeyboardInterrupt raised inside code run by exec() of a
            # string (dataclasses does that at import) as unhandled, even when caught here, and
            # then ends the process by SIGINT (status -2) after a clean SystemExit(130).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
    finally:
        if argv is None:  # the process is this command, and it ends now
            # NOTE: the interpreter's exit collects every object still alive (0.3-0.4 s once
            # torch is loaded); it skips frozen ones, and the OS frees their memory anyway.
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
