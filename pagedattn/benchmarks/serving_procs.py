"""Server processes for bench_serving: `pagedattn serve` and `transformers serve`, same weights."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    """A running server: its process, URL, the model id to send, and extra request fields."""

    proc: subprocess.Popen
    base_url: str
    log_path: Path
    model_id: str = ""
    max_model_len: int | None = None
    extra_body: dict = field(default_factory=dict)

    def log_tail(self, num_chars: int = 1500) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def hf_model_dir(model: str | None, out_dir: Path) -> Path:
    """An HF folder with the model's weights: the folder itself, or a GGUF converted once."""
    if model is not None and (Path(model) / "config.json").exists():
        return Path(model)
    import torch
    from safetensors.torch import save_file

    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import packaged_model_path

    gguf = Path(model) if model is not None else packaged_model_path("smollm2-135m")
    if not gguf.exists():
        gguf = packaged_model_path(str(model))
    target = out_dir / f"hf-{gguf.stem}"
    if (target / "config.json").exists():
        return target
    print(f"[bench_serving] converting {gguf.name} to an HF folder at {target} (once)")
    ckpt = GGUFCheckpoint(gguf)
    config = ckpt.hf_config()
    # NOTE: dequantised once by our GGUF loader, so both servers run the very same bf16 weights.
    weights = {name: w.to(torch.bfloat16).contiguous() for name, w in ckpt.weights(config)}
    target.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(target)
    ckpt.hf_tokenizer().save_pretrained(target)
    return target


def _launch(cmd: list[str], log_path: Path, threads: int | None) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = open(log_path, "w")  # noqa: SIM115 (the child holds it; closed when we exit)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), ""


def _wait_ready(server: ServerProc) -> str | None:
    """None once /health answers 200 and one completion works; else why not."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            return f"exited with {server.proc.returncode}: {server.log_tail(600)!r}"
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        return f"not healthy after {STARTUP_TIMEOUT_S:.0f} s"
    body = {"model": server.model_id, "prompt": "hello", "max_tokens": 2, **server.extra_body}
    try:
        resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError as exc:
        return f"probe request failed: {exc!r}"
    if resp.status_code != 200:
        return f"probe request got HTTP {resp.status_code}: {resp.text[:300]}"
    return None


def start_pagedattn(model_dir: Path, out_dir: Path, threads: int | None) -> ServerProc | str:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedattn.entrypoints.openai.server", "--model", str(model_dir),
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    if threads is not None:
        cmd += ["--threads", str(threads)]
    log_path = out_dir / "serve_pagedattn.log"
    proc, _ = _launch(cmd, log_path, threads)
    server = ServerProc(proc, f"http://127.0.0.1:{port}", log_path, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.model_id and time.monotonic() < deadline and proc.poll() is None:
        try:
            card = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]
            server.model_id, server.max_model_len = card["id"], card["max_model_len"]
        except (httpx.HTTPError, KeyError, ValueError):
            time.sleep(0.5)
    reason = _wait_ready(server)
    if reason is not None:
        server.stop()
        return reason
    return server


def start_transformers(model_dir: Path, out_dir: Path, threads: int | None) -> ServerProc | str:
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    if not Path(exe).exists():
        return "the `transformers` command is not installed"
    port = _free_port()
    cmd = [exe, "serve", "--port", str(port), "--device", "cpu", str(model_dir.resolve())]
    log_path = out_dir / "serve_transformers.log"
    proc, _ = _launch(cmd, log_path, threads)
    server = ServerProc(proc, f"http://localhost:{port}", log_path, str(model_dir.resolve()))
    reason = _wait_ready(server)
    if reason is not None:
        server.stop()
        return reason
    return server
