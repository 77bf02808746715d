"""The `pagedattn` CLI: generate from arguments, a file and stdin; chat with forks; errors."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from pagedattn.entrypoints.chat import ChatSessions, run_chat
from pagedattn.entrypoints.cli import build_parser, main
from tests.model.tiny import make_tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("cli")))


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedattn.entrypoints.cli", *args],
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
    assert "KV cache: 64 blocks x 16 tokens" in res.stdout
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
