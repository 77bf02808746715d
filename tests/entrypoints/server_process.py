"""A live `pagedattn` server in a subprocess on a free port, for the server tests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.model.tiny import make_tiny_llama

STARTUP_TIMEOUT_S = 180.0
# A ChatML template, added to the tiny model when its tokenizer has none.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model_dir(tmp_dir: Path, **overrides: Any) -> Path:
    """The tiny random llama checkpoint (config ``overrides`` applied), with a chat template so
    `/v1/chat/completions` works."""
    path = Path(make_tiny_llama(tmp_dir, **overrides))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.exists() else {}
    if not config.get("chat_template") and not (path / "chat_template.jinja").exists():
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


SERVER_COMMAND = ("-m", "pagedattn.entrypoints.openai.server")
# `pagedattn serve` (with --data-parallel-size N: the Ray Serve ingress in front of N replicas).
CLI_SERVE_COMMAND = ("-m", "pagedattn.cli", "serve")


class ServerProcess:
    """`python -m pagedattn.entrypoints.openai.server` (or `command`) on 127.0.0.1, stopped on
    `stop()`."""

    def __init__(
        self, model_dir: Path, log_file: Path, *args: str, command: tuple[str, ...] = SERVER_COMMAND
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        cmd = [sys.executable, *command, "--model", str(model_dir), "--port", str(self.port),
               "--dtype", "float32", "--threads", "1", "--log-level", "warning", *args]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self._log = open(log_file, "w")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_file.read_text()[-num_chars:]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def read_metrics(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value}, and {'name': value} summed over labels."""
    text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10.0).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        values[name + labels] = value
        if labels:
            values[name] = values.get(name, 0.0) + value
    return values


def wait_idle(
    base_url: str, timeout: float = 10.0, headers: dict | None = None
) -> dict[str, float]:
    """Poll `/metrics` until nothing runs or waits and no KV block is in use; return the last."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(base_url, headers)
        idle = (
            m["pagedattn_num_requests_running"] == 0
            and m["pagedattn_num_requests_waiting"] == 0
            and m["pagedattn_kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


class InProcessServer:
    """uvicorn serving `app` on 127.0.0.1 from a thread of this process; `stop()` ends it."""

    def __init__(self, app, server_cls=None, **config) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", **config)
        self.server = (server_cls or uvicorn.Server)(cfg)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"in-process server did not start: {self.error!r}")
            time.sleep(0.02)

    def _run(self) -> None:
        try:
            self.server.run()
        except BaseException as exc:  # SystemExit from _GracefulServer after a fault
            self.error = exc

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
