"""Command-line options shared by `generate`, `chat` and `serve`: engine flags, sampling flags.

The engine flags are generated from pagedattn.config (defaults written there once); the sampling
flags are the CLI's own defaults (greedy, 64 tokens), not SamplingParams()'s (vLLM's: temperature
1.0, 16 tokens).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from pagedattn.config import EngineConfig, cli_kwargs

# NOTE: the CLI samples greedily and longer than SamplingParams() does: a one-shot command line
# should print the model's best answer, not a 16-token random draw.
CLI_MAX_TOKENS = 64
CHAT_MAX_TOKENS = 256
CLI_TEMPERATURE = 0.0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless its help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is None or not action.option_strings:
            return text
        return super()._get_help_string(action)


def add_engine_args(
    parser: argparse.ArgumentParser, *, exclude: Iterable[str] = ()
) -> argparse._ArgumentGroup:
    """The engine's flags (one per EngineConfig option), minus ``exclude`` (flat names)."""
    group = EngineConfig.add_cli_args(parser, exclude=exclude)
    for action in group._group_actions:
        if action.type not in (None, int, float, str):
            action.type = _clear_errors(action.type)
        if action.choices is not None and None in action.choices:
            # NOTE: --help shows the default as "none": accept that spelling for None.
            action.type = _none_or(action.type)
    return group


def _clear_errors(parse):
    """A flag's parser whose ValueError message argparse shows (not "invalid parse_size value")."""

    def parse_flag(text: str):
        try:
            return parse(text)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse_flag.__name__ = getattr(parse, "__name__", "value")
    return parse_flag


def _none_or(parse):
    def parse_flag(text: str):
        return None if text.strip().lower() == "none" else parse(text)

    parse_flag.__name__ = getattr(parse, "__name__", "value")
    return parse_flag


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int = CLI_MAX_TOKENS) -> None:
    """Sampling flags; ``--seed`` here seeds each request (dest ``sampling_seed``)."""
    g = parser.add_argument_group("sampling options (the CLI's defaults: greedy)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate")
    g.add_argument("--temperature", type=float, default=CLI_TEMPERATURE, help="0 samples greedily")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=None, help="top-k sampling (default: off)")
    g.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="per-request sampling seed (default: none; the engine's random state, seed 0)",
    )
    g.add_argument("-n", type=int, default=1, help="sequences per prompt (they share its blocks)")


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the parsed sampling flags."""
    from pagedattn.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        n=args.n,
    )


def build_llm(args: argparse.Namespace):
    """The offline LLM for parsed engine flags (verbose: prints the KV cache it allocated)."""
    from pagedattn.engine.llm import LLM

    return LLM(**cli_kwargs(args), verbose=True)


def options_markdown() -> str:
    """The README's tables of engine and sampling flags, generated from the parsers."""
    tables = []
    for title, add in (("engine option", add_engine_args), ("sampling option", add_sampling_args)):
        parser = argparse.ArgumentParser(add_help=False, formatter_class=HelpFormatter)
        add(parser)
        formatter = parser._get_formatter()
        engine = add is add_engine_args
        header = (
            f"| {title} | " + ("`LLM(...)` keyword | " if engine else "") + "meaning (default) |"
        )
        rows = [header, "|---|---|---|" if engine else "|---|---|"]
        for action in parser._actions:
            flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
            if action.choices:
                flags += f" `{{{','.join(map(str, action.choices))}}}`"
            keyword = f"`{action.dest}` | " if engine else ""
            rows.append(f"| {flags} | {keyword}{formatter._expand_help(action)} |")
        tables.append("\n".join(rows))
    return "\n\n".join(tables)


# `pagedattn serve`'s options live here, not in the server module, so that parsing the command
# line does not import the web stack (FastAPI, uvicorn) for generate, chat or bench.
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
# /health answers 503 "degraded" once a step or a front-end job has run this long.
DEFAULT_HEALTH_STALL_S = 30.0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of `pagedattn serve`: the engine's plus host, port, keys and model name."""
    add_engine_args(parser)
    g = parser.add_argument_group("server options")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=None,
        help="accepted API keys (repeatable); each key gets its own prefix-cache namespace "
        "(default: PAGEDATTN_API_KEY's comma-separated keys, else no key needed)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients must send (default: the model's name)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="seconds in-flight requests may finish after SIGTERM/SIGINT before being aborted",
    )
    g.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="logging"
    )
    g.add_argument(
        "--metrics-public",
        action="store_true",
        help="serve /metrics without an API key even when keys are set (default: it needs one)",
    )
    g.add_argument(
        "--health-stall-s",
        type=float,
        default=DEFAULT_HEALTH_STALL_S,
        help="/health answers 503 degraded when an engine step or a tokenise job has "
        "run longer than this",
    )
    add_limit_args(g)
    g.add_argument(
        "--lora-modules",
        action="extend",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) to serve, selected by the `model` field; needs "
        "--enable-lora",
    )
    g.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; behind the API key when keys are set)",
    )
    g.add_argument(
        "--lora-root",
        default=None,
        metavar="DIR",
        help="the folder runtime adapter loads read under (a lora_path is relative to it; "
        "nothing outside it, symlinks and `..` resolved); needed for runtime loads",
    )
    add_agent_args(g)
    from pagedattn.serve.args import add_distributed_args

    add_distributed_args(parser)


def add_agent_args(group) -> None:
    """Tool calling and reasoning options (vLLM's names); docs/agent-api.md explains them."""
    from pagedattn.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from pagedattn.entrypoints.openai.tool_parsers import TOOL_PARSERS

    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls (hermes: Qwen/Hermes <tool_call>; llama3_json; "
        "mistral [TOOL_CALLS]; pythonic); default: hermes for a chat template without tool "
        "support (it gets the generic tool prompt), else none",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (the model decides; its calls are parsed); "required" '
        "and named choices work without it",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split the model's <think> block into reasoning_content (deepseek_r1, qwen3)",
    )


def add_limit_args(group) -> None:
    """The server's request limits (body size, prompt size)."""
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted (413 above it)",
    )
    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt text accepted before tokenising (default: max_model_len x 8 "
        "characters, or x the longest token if shorter; a prompt of more characters is refused "
        "before any tokenisation)",
    )
