"""The README's and the docs' snippets run as written (issue 52, item 8).

Every `curl` command of a bash block, every `python -c` line, and every Python block that talks to
a server or uses the Python API, in README.md and docs/*.md (not docs/benchmarks.md: history), is
one test case named `FILE:LINE`. Server snippets run against ONE live `pagedattn serve` on
loopback (the default SmolLM2 GGUF model), started with the options the docs' serve lines name
(an API key, tool choice, LoRA with runtime loads under an adapter root). The rewrite rules:

- `localhost:8000` becomes the fixture's 127.0.0.1:PORT;
- the key placeholders (`Bearer KEY`, `api_key="KEY"`, `api_key="none"`) become the fixture's
  key, and a curl
  command without an authorization header gets one (the docs' keyless lines are for a keyless
  server; the fixture has a key, as the README's serve line does);
- a placeholder path (`path/to/base`, `path/to/hf-folder`) becomes the packaged default model, and
  `path/to/sql-adapter` a random PEFT adapter of its shapes.

A snippet the suite cannot run is in SKIPPED with its reason (never skipped silently), and a
SKIPPED entry that names no snippet fails. Outputs are checked loosely: HTTP 200, the body parses
as JSON (or as SSE events of JSON ending in [DONE]), the endpoint's main field is there.

The `pagedattn ...` command lines (which start models or replicas, so they do not run here) are
checked against their `--help`: every option they pass exists.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.server_process import CLI_SERVE_COMMAND, ServerProcess

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"
)
API_KEY = "snippet-test-key"
MODEL = "smollm2-135m"
# Python blocks that run: they talk to a server or use the package (the others describe types).
PYTHON_MARKERS = ("localhost:8000", "from pagedattn", "import pagedattn", "LLM(")
# The main field of each endpoint's JSON answer.
FIELDS = {"/v1/completions": "choices", "/v1/chat/completions": "choices",
          "/v1/responses": "output", "/v1/embeddings": "data", "/v1/models": "data"}  # fmt: skip
SKIPPED = {
    "docs/scaling.md:30": "tensor parallelism over 2 ranks: two model processes, too heavy for "
    "the default suite (tests/distributed and tests/serve/test_multi_node_tp.py run TP)",
}
# Snippets run only with -m slow (a minute of CPU or more on 2 cores), with the reason.
SLOW = {
    "README.md:149": "two LLM loads, n=4 sampling and beam search of width 4 (~80 s of CPU)",
}


def _blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line of the first code line, text) of each fenced block."""
    blocks, lang, start, lines = [], None, 0, []
    for num, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```"):
            if lang is None:
                lang, start, lines = line[3:].strip() or "text", num + 1, []
            else:
                blocks.append((lang, start, "\n".join(lines)))
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def _complete(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:  # a quote still open: the command goes on on the next line
        return False
    return True


def _commands(text: str, start: int) -> list[tuple[int, str]]:
    """(line, command) of a bash block: backslash continuations and open quotes joined."""
    out, first, command = [], 0, ""
    for i, line in enumerate(text.splitlines()):
        if not command:
            first = start + i
        command += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\") and _complete(command):
            out.append((first, command.strip()))
            command = ""
        elif not line.endswith("\\"):
            command += "\n"
    return out


def collect() -> list[tuple[str, str, str]]:
    """(id FILE:LINE, kind curl|python|python-c, text) of every snippet."""
    found = []
    for path in DOC_FILES:
        rel = path.relative_to(ROOT).as_posix()
        for lang, start, text in _blocks(path):
            if lang == "python" and any(m in text for m in PYTHON_MARKERS):
                found.append((f"{rel}:{start}", "python", text))
            elif lang in ("bash", "sh", "shell"):
                for line, cmd in _commands(text, start):
                    if cmd.startswith("curl "):
                        found.append((f"{rel}:{line}", "curl", cmd))
                    elif re.search(r"python -c ", cmd):
                        found.append((f"{rel}:{line}", "python-c", cmd))
    return found


SNIPPETS = collect()


def _cli_lines() -> list[tuple[str, list[str]]]:
    """(id FILE:LINE, argv after `pagedattn`) of every `pagedattn ...` command line of the docs."""
    found = []
    for path in DOC_FILES:
        rel = path.relative_to(ROOT).as_posix()
        for lang, start, text in _blocks(path):
            if lang not in ("bash", "sh", "shell"):
                continue
            for line, cmd in _commands(text, start):
                argv = shlex.split(cmd, comments=True)
                if argv and argv[0] in ("pagedattn", ".venv/bin/pagedattn"):
                    found.append((f"{rel}:{line}", [a.strip("[]") for a in argv[1:]]))
    return found


@functools.cache
def _help(*subcommand: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedattn.cli", *subcommand, "--help"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _write_adapter(folder: Path, seed: int) -> Path:
    """A rank-4 PEFT LoRA of SmolLM2-135M's q_proj and v_proj (random, small)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    rank, hidden, kv_out, layers = 4, 576, 192, 30
    tensors = {}
    for layer in range(layers):
        for module, out_dim in (("q_proj", hidden), ("v_proj", kv_out)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.01
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": ["q_proj", "v_proj"], "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    _write_adapter(root / "sql-adapter", seed=1)
    _write_adapter(root / "chat-adapter", seed=2)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
    log = tmp_path_factory.mktemp("snippets") / "serve.log"
    # NOTE: the docs' examples name the model SmolLM2-135M-Instruct, the default served name.
    srv = ServerProcess(
        MODEL, log, "--api-key", API_KEY, "--enable-auto-tool-choice",
        "--enable-lora", "--max-lora-rank", "16", "--lora-modules",
        f"sql={adapters / 'sql-adapter'}", "--enable-lora-runtime-updates",
        "--lora-root", str(adapters), "--max-model-len", "2048", "--num-blocks", "512",
        command=CLI_SERVE_COMMAND,
    )  # fmt: skip
    yield srv
    srv.stop()


def _rewrite_for_server(text: str, base_url: str) -> str:
    host = base_url.removeprefix("http://")
    text = text.replace("http://localhost:8000", base_url).replace("localhost:8000", host)
    text = text.replace("Bearer KEY", f"Bearer {API_KEY}")
    text = text.replace('api_key="KEY"', f'api_key="{API_KEY}"')
    return text.replace('api_key="none"', f'api_key="{API_KEY}"')


def _rewrite_paths(text: str, adapters: Path) -> str:
    text = text.replace('"path/to/sql-adapter"', repr(str(adapters / "sql-adapter")))
    return text.replace('"path/to/base"', repr(MODEL)).replace('"path/to/hf-folder"', repr(MODEL))


def _check_http_body(path: str, body: str) -> None:
    """The body is JSON (or SSE events of JSON ending in [DONE]) holding the endpoint's field."""
    events = [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]
    if events:
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and all("choices" in c for c in chunks if "usage" not in c), chunks[:2]
        return
    data = json.loads(body)
    assert data.get("error") is None, data  # a Response object has "error": null
    if path in FIELDS:
        assert FIELDS[path] in data, data


def _run_curl(cmd: str, base_url: str) -> None:
    cmd = _rewrite_for_server(cmd, base_url)
    args = shlex.split(cmd)
    if not any("authorization:" in a.lower() for a in args):
        args += ["-H", f"authorization: Bearer {API_KEY}"]
    url = next(a for a in args if a.startswith("127.0.0.1:") or a.startswith("http"))
    path = "/" + url.split("/", 1)[1]
    proc = subprocess.run(
        [*args, "-sS", "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    body, _, status = proc.stdout.rpartition("\n")
    assert status == "200", f"{status}: {body[:2000]}"
    _check_http_body(path, body)


def _run_python(code: str) -> str:
    out = io.StringIO()
    namespace: dict = {"__name__": "__snippet__"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102 (the docs' own code)
    namespace.clear()
    gc.collect()  # each snippet's LLM goes before the next one loads
    return out.getvalue()


def test_every_skipped_snippet_exists():
    ids = {sid for sid, _, _ in SNIPPETS}
    assert set(SKIPPED) | set(SLOW) <= ids, (set(SKIPPED) | set(SLOW)) - ids
    assert len(SNIPPETS) >= 10, SNIPPETS  # the extraction found the docs' examples


@pytest.mark.parametrize("sid, argv", _cli_lines(), ids=[sid for sid, _ in _cli_lines()])
def test_cli_line_names_only_existing_options(sid, argv):
    """Every option a `pagedattn ...` line of the docs passes is one its `--help` lists."""
    subcommand = argv[:2] if argv[:1] == ["bench"] and argv[1:2] != ["--help"] else argv[:1]
    text = _help(*subcommand)
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if re.fullmatch(r"--?[a-zA-Z][\w-]*", flag) and flag != "--help":
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{sid}: {flag}"


@pytest.mark.parametrize(
    "sid, kind, text",
    [pytest.param(*s, id=s[0], marks=[pytest.mark.slow] if s[0] in SLOW else []) for s in SNIPPETS],
)
def test_snippet_runs_as_written(sid, kind, text, request, adapters):
    if sid in SKIPPED:
        pytest.skip(SKIPPED[sid])
    talks_to_server = kind == "curl" or "localhost:8000" in text
    if talks_to_server:
        base_url = request.getfixturevalue("server").base_url
    if kind == "curl":
        _run_curl(text, base_url)
    elif kind == "python-c":
        code = shlex.split(text)[shlex.split(text).index("-c") + 1]
        _run_python(_rewrite_paths(code, adapters))
    else:
        code = _rewrite_paths(text, adapters)
        if talks_to_server:
            code = _rewrite_for_server(code, base_url)
        printed = _run_python(code)
        if "print(" in text:
            assert printed.strip(), f"{sid} printed nothing"
