"""llama.cpp as a peer: continuous batching through llama-cpp-python, or llama-batched-bench.

llama.cpp's default CPU buffer types include repacked and AMX weight layouts (``use_extra_bufts``,
on by default), which run its fastest kernels but crashed it with a segfault on an AMX Xeon for
every quantised file. So each llama-cpp-python run goes to a child process
(``python -m pagedattn.benchmarks.llama_cpp_peer TASK JOB RESULT``): first with the default
buffer types, and where that child crashes, again with ``use_extra_bufts`` off. The result says
which ran, and its peak RSS is the child's own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from pagedattn.benchmarks.gguf_retype import gguf_type_name, retyped_gguf
from pagedattn.benchmarks.pagedattn_runner import (
    PeerUnavailableError,
    RunOptions,
    RunResult,
    checkpoint_weight_bytes,
    peak_rss_mib,
    warmup_ids,
)
from pagedattn.benchmarks.workloads import Workload, workload_from_dict, workload_to_dict

# RunOptions.llama_cpp_extra_bufts: auto = the defaults, and off where they crash.
EXTRA_BUFTS_CHOICES = ("auto", "on", "off")
CHILD_TIMEOUT_S = 3600.0
LOG_TAIL_LINES = 15
# The folder that holds the pagedattn package, for the child's PYTHONPATH.
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


class LlamaCppCrashError(RuntimeError):
    """llama.cpp's child process died (a signal, or exited without a result)."""


def gguf_file_type(path: Path) -> str:
    """The file type a GGUF states, as llama.cpp names it (F16, Q8_0, Q4_K_M, ...)."""
    import gguf

    from pagedattn.model.gguf_file import GGUFFile

    file_type = GGUFFile(path).fields.get("general.file_type")
    if file_type is None:
        return "unknown"
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"file type {file_type}"


def gguf_path(opts: RunOptions) -> tuple[Path, str]:
    """The GGUF file llama.cpp runs (RunOptions.llama_cpp_model, else per llama_cpp_weights)
    and its weights in words."""
    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import resolve_checkpoint

    if opts.llama_cpp_model:
        path = Path(opts.llama_cpp_model)
        return path, "as stored: " + gguf_file_type(path)
    ckpt = resolve_checkpoint(opts.model)
    if not isinstance(ckpt, GGUFCheckpoint):
        raise PeerUnavailableError(f"llama.cpp needs a .gguf model; {opts.model!r} is not one")
    if opts.llama_cpp_weights == "gguf":
        return ckpt.path, "as shipped: " + gguf_file_type(ckpt.path)
    dtype = opts.dtype if opts.llama_cpp_weights == "dtype" else opts.llama_cpp_weights
    return retyped_gguf(ckpt.path, dtype), gguf_type_name(dtype) + ", dequantised from the GGUF"


# Running llama.cpp in a child process.


def run_isolated(task: str, job: dict, extra_bufts: str = "auto") -> dict:
    """``task``'s result from a child process; with ``extra_bufts`` auto, the default buffer
    types first and, where that child crashes, ``use_extra_bufts`` off. The result's
    ``buffer_types`` says which ran."""
    if extra_bufts not in EXTRA_BUFTS_CHOICES:
        raise ValueError(f"extra_bufts={extra_bufts!r}: choose from {EXTRA_BUFTS_CHOICES}")
    tries = {"auto": (True, False), "on": (True,), "off": (False,)}[extra_bufts]
    crashes = []
    for use in tries:
        try:
            result = _spawn(task, job | {"use_extra_bufts": use})
        except LlamaCppCrashError as exc:
            crashes.append(str(exc))
            print(f"llama.cpp with use_extra_bufts={use} crashed: {exc}", flush=True)
            continue
        if use:
            result["buffer_types"] = "default (use_extra_bufts on)"
            result["extra_bufts"] = "on"
        elif crashes:
            result["buffer_types"] = f"use_extra_bufts off (the default crashed: {crashes[0]})"
            result["extra_bufts"] = f"off, on crashed ({crashes[0]})"
        else:
            result["buffer_types"] = "use_extra_bufts off (as asked)"
            result["extra_bufts"] = "off"
        return result
    raise RuntimeError("llama.cpp crashed: " + "; ".join(crashes))


def _spawn(task: str, job: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="pagedattn-llama-cpp-") as tmp:
        job_path, result_path, log_path = (Path(tmp) / n for n in ("job", "result", "log"))
        job_path.write_text(json.dumps(job))
        cmd = [sys.executable, "-m", __name__, task, str(job_path), str(result_path)]
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")]),
        )
        try:
            with log_path.open("w") as log:
                proc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=CHILD_TIMEOUT_S
                )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"llama.cpp {task} timed out after {CHILD_TIMEOUT_S:.0f} s") from exc
        text = result_path.read_text() if result_path.exists() else ""
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    if not text:
        how = (
            signal.Signals(-proc.returncode).name
            if proc.returncode < 0
            else f"exit code {proc.returncode} without a result"
        )
        print(tail, flush=True)
        raise LlamaCppCrashError(how)
    result = json.loads(text)
    if "error" in result:
        print(tail, flush=True)
        raise RuntimeError(f"llama.cpp {task}: {result['error']}")
    return result


def load_model(L, path: str, use_extra_bufts: bool):  # noqa: N803
    """A llama.cpp model from a GGUF file, with or without its extra buffer types."""
    mparams = L.llama_model_default_params()
    mparams.use_extra_bufts = use_extra_bufts
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def _throughput_task(L, job: dict) -> dict:  # noqa: N803
    opts = RunOptions(**job["opts"])
    workload = workload_from_dict(job["workload"])
    result = _run_llama_cpp_python(L, opts, workload, job["gguf"], job["use_extra_bufts"])
    return result.to_dict()


def _nll_task(L, job: dict) -> dict:  # noqa: N803
    return {
        "nll": llama_cpp_nll(L, job["gguf"], job["tokens"], job["threads"], job["use_extra_bufts"])
    }


TASKS = {"throughput": _throughput_task, "nll": _nll_task}


def child_main(argv: list[str]) -> int:
    """The child process: run one task, write its result (or the Python error) as JSON."""
    task, job_path, result_path = argv
    job = json.loads(Path(job_path).read_text())
    try:
        import llama_cpp

        result = TASKS[task](llama_cpp, job)
        result["peak_rss_mib"] = peak_rss_mib()
    except Exception as exc:  # NOTE: a Python error is reported, not retried as a crash
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(result_path).write_text(json.dumps(result))
    return 0


# Throughput.


def run_llama_cpp(opts: RunOptions, workload: Workload) -> RunResult:
    """llama.cpp on the same GGUF: `llama-batched-bench` if given, else llama-cpp-python."""
    if opts.llama_batched_bench:
        return _run_batched_bench(opts, workload)
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailableError(
            "llama-cpp-python is not installed (make bench-peers installs it) and no "
            "--llama-batched-bench binary was given"
        )
    gguf_file, weights = gguf_path(opts)
    job = {"opts": asdict(opts), "workload": workload_to_dict(workload), "gguf": str(gguf_file)}
    data = run_isolated("throughput", job, opts.llama_cpp_extra_bufts)
    data["extra"]["note"] += f", weights {weights}, buffer types {data['buffer_types']}"
    data["extra"] |= {"extra_bufts": data["extra_bufts"], "weights_file": str(gguf_file)}
    data["extra"]["weight_bytes"] = checkpoint_weight_bytes(str(gguf_file))
    fields = RunResult.__dataclass_fields__
    return RunResult(**{k: v for k, v in data.items() if k in fields})


def _run_llama_cpp_python(
    L,  # noqa: N803
    opts: RunOptions,
    workload: Workload,
    path: str,
    use_extra_bufts: bool,
) -> RunResult:
    """Continuous batching through llama.cpp's C API (as llama-server's slots do it).

    Up to ``hf_batch_size`` sequences run at once, each with its own sequence id and its own KV
    stream sized for the longest request (llama.cpp's default, non-unified cache: with a unified
    one every token attends over all cells, masked, and a 32-sequence uniform run measured 62.6
    tok/s); every llama_decode call carries one token per running sequence plus prompt tokens
    of newly admitted ones (up to n_batch), greedy argmax over each returned row of logits. A
    finished sequence's cells are released (llama_memory_seq_rm) and the next request takes its
    slot. No prefix reuse between sequences.
    """
    import numpy as np

    model = load_model(L, path, use_extra_bufts)
    reqs = workload.requests
    slots = max(1, min(opts.hf_batch_size, len(reqs)))
    per_seq = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs) + 16
    per_seq = -(-per_seq // 256) * 256
    n_batch = 2048
    cparams = L.llama_context_default_params()
    cparams.n_ctx = slots * per_seq
    cparams.n_batch = n_batch
    cparams.n_ubatch = 512
    cparams.n_seq_max = slots
    cparams.kv_unified = False
    cparams.n_threads = cparams.n_threads_batch = opts.threads
    ctx = L.llama_init_from_model(model, cparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(n_batch, 0, 1)
    memory = L.llama_get_memory(ctx)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, seq_id, wants_logits)."""
        for i, (tok, pos, seq, want) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want
        batch.n_tokens = len(entries)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i: int) -> int:
        row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
        return int(row.argmax())

    # Warm-up on a throwaway sequence.
    warm = warmup_ids(workload)
    decode([(t, p, 0, p == len(warm) - 1) for p, t in enumerate(warm)])
    L.llama_memory_seq_rm(memory, 0, -1, -1)

    free_slots = list(range(slots))
    waiting = list(range(len(reqs)))
    running: dict[int, dict] = {}  # seq id -> state
    ttft, tpot, num_out = [0.0] * len(reqs), [], 0
    t0 = time.perf_counter()
    while waiting or running:
        entries, owners = [], []
        for seq, st in running.items():
            if st["prefilled"]:
                entries.append((st["out"][-1], st["pos"], seq, True))
                owners.append(seq)
        while waiting and free_slots:  # admit into free slots; prompts are fed below
            seq = free_slots.pop(0)
            running[seq] = {"req": waiting.pop(0), "pos": 0, "prefilled": False, "out": []}
        budget = n_batch - len(entries)
        for seq, st in running.items():  # prompts in admission order, chunk by chunk
            prompt = reqs[st["req"]].prompt_token_ids
            while not st["prefilled"] and budget > 0:
                p = st["pos"]
                last = p == len(prompt) - 1
                entries.append((prompt[p], p, seq, last))
                owners.append(seq if last else -1)
                st["pos"] += 1
                st["prefilled"] = last
                budget -= 1
        decode(entries)
        now = time.perf_counter()
        for i, seq in enumerate(owners):
            if seq < 0:
                continue
            st = running[seq]
            if st["out"]:
                st["pos"] += 1  # the token fed this step now sits in the cache
            st["out"].append(argmax(i))
            if len(st["out"]) == 1:
                st["first"] = now
                ttft[st["req"]] = now - t0
            if len(st["out"]) >= reqs[st["req"]].max_tokens:
                num_out += len(st["out"])
                if len(st["out"]) > 1:
                    tpot.append((now - st["first"]) / (len(st["out"]) - 1))
                L.llama_memory_seq_rm(memory, seq, -1, -1)
                del running[seq]
                free_slots.append(seq)
    elapsed = time.perf_counter() - t0
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return RunResult(
        "llama_cpp",
        workload.name,
        elapsed,
        len(reqs),
        workload.num_prompt_tokens,
        num_out,
        ttft,
        tpot,
        extra={
            "note": f"llama-cpp-python {L.__version__}, continuous batching over {slots} "
            "sequences, no prefix reuse",
            "kv_cache_dtype": _ggml_type_name(L, cparams.type_k, cparams.type_v),
        },
    )


def _ggml_type_name(L, type_k: int, type_v: int) -> str:  # noqa: N803
    """llama.cpp's KV cache types by name (f16 unless a context parameter says otherwise)."""
    names = {
        int(getattr(L, f"GGML_TYPE_{n.upper()}")): n
        for n in ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
        if hasattr(L, f"GGML_TYPE_{n.upper()}")
    }
    k, v = names.get(int(type_k), f"type {type_k}"), names.get(int(type_v), f"type {type_v}")
    return k if k == v else f"key {k} / value {v}"


# Quality.


def llama_cpp_nll(L, path: str, tokens: list[int], threads: int, use_extra_bufts: bool) -> float:  # noqa: N803
    """Mean negative log-likelihood of tokens[1:] given their prefixes, in llama.cpp."""
    import numpy as np

    model = load_model(L, path, use_extra_bufts)
    chunk = 128
    cparams = L.llama_context_default_params()
    cparams.n_ctx = -(-(len(tokens) + 1) // 256) * 256
    cparams.n_batch = cparams.n_ubatch = chunk
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cparams)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(chunk, 0, 1)
    total = 0.0
    for lo in range(0, len(tokens) - 1, chunk):
        part = tokens[lo : min(lo + chunk, len(tokens) - 1)]
        for i, tok in enumerate(part):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, lo + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        batch.n_tokens = len(part)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(part), n_vocab))
        logits = logits.astype(np.float64)  # [chunk, vocab]
        top = logits.max(axis=1)
        logz = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        target = np.array(tokens[lo + 1 : lo + 1 + len(part)])
        total += float((logz - logits[np.arange(len(part)), target]).sum())
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return total / (len(tokens) - 1)


# llama-batched-bench.


def parse_batched_bench(text: str) -> dict[str, float]:
    """The first data row of llama-batched-bench's markdown table, keyed by column name."""
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "T_PP s" in cells:
            header = cells
        elif header and len(cells) == len(header) and re.fullmatch(r"[\d.]+", cells[0]):
            return {k: float(v) for k, v in zip(header, cells, strict=True)}
    raise ValueError("no result row in llama-batched-bench output (is it a llama.cpp build?)")


def _run_batched_bench(opts: RunOptions, workload: Workload) -> RunResult:
    binary = shutil.which(opts.llama_batched_bench) or opts.llama_batched_bench
    if not Path(binary).exists():
        raise PeerUnavailableError(f"llama-batched-bench not found at {opts.llama_batched_bench}")
    reqs = workload.requests
    shapes = {(len(r.prompt_token_ids), r.max_tokens) for r in reqs}
    if len(shapes) != 1 and workload.warm_prefix is None:
        raise PeerUnavailableError(
            f"llama-batched-bench runs equal-length requests only; skipped on {workload.name}"
        )
    shared = workload.warm_prefix is not None
    num_prompt, num_new = max(shapes)
    batch = len(reqs)
    ctx = num_prompt + batch * num_new if shared else batch * (num_prompt + num_new)
    gguf_file, weights = gguf_path(opts)
    cmd = [
        binary,
        *("-m", str(gguf_file), "-c", str(ctx + 16), "-b", "2048", "-ub", "512"),
        *("-npp", str(num_prompt), "-ntg", str(num_new), "-npl", str(batch)),
        *("-t", str(opts.threads)),
    ] + (["-pps"] if shared else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-500:]}")
    row = parse_batched_bench(proc.stdout + proc.stderr)
    num_prompt_total = num_prompt if shared else batch * num_prompt
    return RunResult(
        "llama_cpp",
        workload.name,
        row["T s"],
        batch,
        num_prompt_total,
        batch * num_new,
        [row["T_PP s"]] * batch,
        [row["T_TG s"] / num_new] * batch,
        extra={
            "note": f"llama-batched-bench, weights {weights}",
            "kv_cache_dtype": "f16",  # llama-batched-bench's default -ctk / -ctv
            "shared_prompt": shared,
            "row": row,
            "weight_bytes": checkpoint_weight_bytes(str(gguf_file)),
        },
    )


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
