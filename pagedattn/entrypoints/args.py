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


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Options of `pagedattn serve`: the engine's, then ServeConfig's (server, replicas).

    NOTE: ServeConfig lives in serve_config.py, not in the server module, so that parsing the
    command line does not import the web stack (FastAPI, uvicorn) for generate, chat or bench.
    """
    from pagedattn.entrypoints.serve_config import ServeConfig

    add_engine_args(parser)
    ServeConfig.add_cli_args(parser)
