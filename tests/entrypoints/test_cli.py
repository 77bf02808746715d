"""The `pagedattn` CLI: generate from arguments, a file and stdin; chat with forks; errors."""

from __future__ import annotations

import ast
import io
import subprocess
import sys
from pathlib import Path

import pytest

import pagedattn.benchmarks
import pagedattn.entrypoints
from pagedattn.cli import build_parser, main
from pagedattn.config import engine_options
from pagedattn.entrypoints.chat import ChatSessions, run_chat
from tests.model.tiny import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("cli")))


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedattn.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_from_arguments_prints_outputs_and_kv_summary(tiny_model):
    res = _cli(
        "generate",
        "the a",
        "a the the",
        "--model",
        tiny_model,
        "--dtype",
        "float32",
        "--max-tokens",
        "5",
        "--raw",
        "--num-blocks",
        "64",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("### ") == 2
    assert "(5 tokens, length)" in res.stdout or "tokens, stop)" in res.stdout
    assert res.stdout.count("KV cache: 64 blocks x 16 tokens") == 1  # printed once
    assert "[kv] prefix cache:" in res.stdout


def test_generate_reads_a_file_and_stdin(tiny_model, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the a\n\na the\nthe the the\n")
    common = ("--model", tiny_model, "--dtype", "float32", "--max-tokens", "3", "--raw")
    from_file = _cli("generate", "--file", str(prompts), *common)
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout.count("### ") == 3
    from_stdin = _cli("generate", *common, stdin="a a\nthe\n")
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert from_stdin.stdout.count("### ") == 2


def test_bad_model_path_is_a_clear_error():
    res = _cli("generate", "hi", "--model", "/no/such/model")
    assert res.returncode == 2
    assert "error:" in res.stderr and "/no/such/model" in res.stderr
    assert "Traceback" not in res.stderr


def test_bad_sampling_value_is_a_clear_error(tiny_model):
    assert main(["generate", "x", "--model", tiny_model, "--top-p", "1.5"]) == 2


def test_chat_turns_reuse_cached_blocks_and_fork(tiny_model, capsys):
    args = build_parser().parse_args(
        [
            "chat",
            "--model",
            tiny_model,
            "--dtype",
            "float32",
            "--max-tokens",
            "4",
            "--block-size",
            "4",
            "--num-blocks",
            "128",
        ]
    )
    script = "the a the a the\n/fork side\na the\n/switch main\n/sessions\n/stats\n/quit\n"
    out = io.StringIO()
    assert run_chat(args, stdin=io.StringIO(script), stdout=out) == 0
    text = out.getvalue()
    assert "forked 'side'" in text
    replies = [line for line in text.splitlines() if "prompt tokens from cached blocks" in line]
    assert len(replies) == 2
    # The forked session's prompt starts with the whole first turn: its blocks are reused.
    cached = int(replies[1].split(";")[1].split("of")[0])
    assert cached > 0
    assert "*main" in text and "side (" in text


def test_chat_sessions_commands():
    chats = ChatSessions()
    chats.history.append({"role": "user", "content": "x"})
    assert "forked" in chats.fork("b")
    assert chats.current == "b" and chats.history == [{"role": "user", "content": "x"}]
    assert "cannot fork" in chats.fork("b")
    assert "no session" in chats.switch("zzz")
    assert chats.handle_command("/quit") is None


def test_an_empty_prompt_is_a_clear_error_before_any_model_loads(capsys):
    # The model path does not exist: reaching the loader would report that instead.
    assert main(["generate", "hi", "  ", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "prompt 2 is empty" in err and "/no/such/model" not in err


def test_help_shows_every_engine_option_with_its_default(capsys):
    for command in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for name, opt in engine_options().items():
            if name == "seed" and command != "serve":
                continue  # on generate and chat --seed is the per-request sampling seed
            flag = (opt.field.metadata["flags"] or (f"--{name.replace('_', '-')}",))[0]
            assert flag in text, (command, flag)
        assert "--block-size BLOCK_SIZE tokens per KV cache block (default: 16)" in text
        assert "(default: auto)" in text and "--no-prefix-caching" in text
        max_tokens = 256 if command == "chat" else 64
        if command != "serve":
            assert f"tokens to generate (default: {max_tokens})" in text
            assert "0 samples greedily (default: 0.0)" in text


def test_bench_registers_every_benchmark_module_in_the_package():
    package = Path(pagedattn.benchmarks.__file__).parent
    modules = {p.stem for p in package.glob("bench_*.py")}
    registry = pagedattn.benchmarks.available()
    assert {m.split(".")[-1] for m in registry.values()} == modules
    assert {
        "allocator",
        "attention",
        "memory",
        "throughput",
        "serve",
        "decode_step",
        "linear",
    } <= set(registry)
    assert all(pagedattn.benchmarks.describe().values())


@pytest.mark.parametrize("name", sorted(pagedattn.benchmarks.available()))
def test_bench_name_help_prints_that_benchmarks_own_options(name, capsys):
    assert main(["bench", name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pagedattn bench {name}")
    assert "bench_args" not in out and "--" in out


def test_bench_runs_a_benchmark_with_its_options(capsys):
    assert main(["bench", "allocator", "--num-requests", "20", "--max-running", "8"]) == 0
    out = capsys.readouterr().out
    assert "| p50 us per call |" in out and "decode allocate_slots" in out


def test_bench_unknown_name_lists_the_benchmarks(capsys):
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "allocator" in err and "memory" in err


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_entrypoints_import_each_other_without_a_circle():
    root = Path(pagedattn.entrypoints.__file__).parent
    modules = {
        "pagedattn.entrypoints." + ".".join(p.relative_to(root).with_suffix("").parts): p
        for p in root.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {m: _imports(p) & set(modules) for m, p in modules.items()}
    # Only the CLI imports the commands it dispatches to; nothing imports the CLI.
    assert not any("pagedattn.cli" in deps for deps in graph.values())

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(
            d == target or (d not in seen and reaches(d, target, seen | {d})) for d in graph[start]
        )

    assert not [m for m in graph if reaches(m, m, {m})]


def test_readme_lists_the_options_that_help_prints():
    from pagedattn.entrypoints.args import options_markdown

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    begin, end = "<!-- options_markdown: begin -->\n", "\n<!-- options_markdown: end -->"
    documented = readme[readme.index(begin) + len(begin) : readme.index(end)]
    assert documented == options_markdown(), (
        "an option changed: paste the output of `python -c 'from pagedattn.entrypoints.args "
        "import options_markdown; print(options_markdown())'` between the README's markers"
    )
