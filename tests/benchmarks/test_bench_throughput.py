"""bench_throughput end to end on a tiny random model; workloads, traces and report numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedattn.benchmarks import bench_throughput
from pagedattn.benchmarks.llama_cpp_peer import parse_batched_bench
from pagedattn.benchmarks.throughput_report import percentile, step_analysis
from pagedattn.benchmarks.workloads import SIZE_PRESETS, load_trace, make_workloads, save_trace
from tests.model.tiny import TINY_VOCAB_SIZE, make_tiny_llama

SPECIAL = {0, 1, 2, 3, 4}
PEERS = ("hf_static", "hf_batch", "llama_cpp")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model"))


def _param_bytes(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(f.get_tensor(n).numel() * 4 for n in f.keys())
    return total


def _run(tmp_path: Path, model: Path, *extra: str) -> dict:
    out = tmp_path / "out" / "throughput.md"
    argv = [
        "--seed",
        "0",
        "--model",
        str(model),
        "--size",
        "tiny",
        "--dtype",
        "float32",
        "--ceiling-reps",
        "2",
        "--out",
        str(out),
        *extra,
    ]
    assert bench_throughput.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    report["markdown"] = out.read_text()
    return report


def test_end_to_end_rows_ratios_ceiling_and_breakdown(tmp_path, tiny_model, capsys) -> None:
    trace = tmp_path / "trace.json"
    # NOTE: the CPU engines' venvs are not under test here (tests/benchmarks/test_cpu_peers.py).
    engines = ",".join(("pagedattn", *PEERS))
    report = _run(
        tmp_path, tiny_model, "--in-process", "--trace-out", str(trace), "--engines", engines
    )
    rows = {(r["workload"], r["engine"]): r for r in report["results"]}
    expected = {
        (w, e) for w in ("uniform", "sharegpt", "shared_prefix") for e in ("pagedattn", *PEERS)
    } | {("shared_prefix", "pagedattn_nocache")}
    assert set(rows) == expected
    workloads = report["meta"]["workloads"]
    for (workload, engine), row in rows.items():
        if engine == "llama_cpp" and row["status"] == "skipped":
            assert "llama" in row["reason"]  # not installed here: skipped with a reason
            continue
        assert row["status"] == "ok", row
        # Exactly the requested tokens: ignore_eos, and HF static counts only each request's own.
        assert row["num_output_tokens"] == workloads[workload]["num_output_tokens"]
        assert row["gen_tps"] == pytest.approx(row["num_output_tokens"] / row["elapsed_s"])
        assert row["prompt_tps"] == pytest.approx(row["num_prompt_tokens"] / row["elapsed_s"])
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 < row["tpot_p50_s"] <= row["tpot_p99_s"]
        assert row["peak_rss_mib"] > 0
        if engine != "llama_cpp":  # the same float32 checkpoint, as stored and as loaded
            assert row["weight_mib"] == pytest.approx(_param_bytes(tiny_model) / 2**20)
        if engine != "pagedattn":
            paged = rows[(workload, "pagedattn")]
            assert row["paged_over_peer_gen_tps"] == pytest.approx(
                paged["gen_tps"] / row["gen_tps"]
            )
    for workload in ("uniform", "sharegpt", "shared_prefix"):
        steps = rows[(workload, "pagedattn")]["steps"]
        pct = steps["breakdown_all"]
        assert sum(
            pct[p] for p in ("schedule", "prepare", "forward", "sample", "process", "other")
        ) == pytest.approx(100)
        assert pct["overhead"] == pytest.approx(100 - pct["forward"] - pct["sample"])
        assert steps["num_decode_steps"] > 0 and steps["decode_step_s"] > 0
    # Warm prefix cache: the shared blocks hit; with caching off nothing does.
    prefix = report["prefix_caching"]
    assert prefix["hit_rate"] > 0.5
    assert rows[("shared_prefix", "pagedattn_nocache")]["extra"]["prefix_cache_hits"] == 0
    assert prefix["ttft_ratio"] == pytest.approx(
        prefix["ttft_p50_nocache_s"] / prefix["ttft_p50_cached_s"]
    )
    ceiling = report["ceiling"]
    assert ceiling["bandwidth_Bps"] > 0 and ceiling["weight_bytes"] > 0
    for row in ceiling["rows"]:
        assert row["matmul_s"] > 0 and row["bandwidth_floor_s"] > 0
        assert row["step_over_matmul"] == pytest.approx(row["decode_step_s"] / row["matmul_s"])
        # The fastest kernel's pass: the best of every kernel measured at this batch.
        measured = ceiling["kernel_matmul_s"][str(row["batch"])]
        assert row["fastest_matmul_s"] == min(measured.values())
        assert measured[row["fastest_kernel"]] == row["fastest_matmul_s"]
    md = report["markdown"]
    for engine in ("pagedattn", "pagedattn_nocache", "hf_static", "hf_batch"):
        assert f"| {engine} |" in md
    if rows[("uniform", "llama_cpp")]["status"] == "ok":  # which buffer types ran, in its row
        assert "| llama_cpp (extra bufts on) |" in md or "| llama_cpp (extra bufts off" in md
    assert "| peak RSS MiB | weights MiB |" in md
    assert "## Prefix caching" in md and "## pagedattn step breakdown" in md
    assert "thread probe:" in md
    assert f"Machine: {bench_throughput.machine_label(2)}." in md and "fastest kernel" in md
    printed = capsys.readouterr().out
    assert printed.count("uniform        pagedattn ") == 1  # one line per result
    # The saved trace replays the same requests.
    replay = load_trace(trace, TINY_VOCAB_SIZE)
    assert [r.max_tokens for r in replay.requests] == [
        r.max_tokens
        for r in make_workloads(SIZE_PRESETS["tiny"], TINY_VOCAB_SIZE, SPECIAL, 0)[
            "sharegpt"
        ].requests
    ]


def test_failing_peer_is_reported_and_the_run_goes_on(tmp_path, tiny_model, monkeypatch) -> None:
    def broken(opts, workload):
        raise RuntimeError("peer exploded")

    monkeypatch.setitem(bench_throughput.RUNNERS, "hf_static", broken)
    report = _run(
        tmp_path,
        tiny_model,
        "--in-process",
        "--engines",
        "hf_static,pagedattn",
        "--workloads",
        "uniform",
        "--no-ceiling",
    )
    rows = {r["engine"]: r for r in report["results"]}
    assert rows["hf_static"]["status"] == "error"
    assert "peer exploded" in rows["hf_static"]["reason"]
    assert rows["pagedattn"]["status"] == "ok"


def test_subprocess_child_measures_its_own_rss(tmp_path, tiny_model) -> None:
    report = _run(
        tmp_path, tiny_model, "--engines", "pagedattn", "--workloads", "uniform", "--no-ceiling"
    )
    (row,) = report["results"]
    assert row["status"] == "ok", row
    assert row["num_output_tokens"] == report["meta"]["workloads"]["uniform"]["num_output_tokens"]
    assert row["peak_rss_mib"] > 50  # a torch process, measured inside the child


def test_workloads_are_seeded_clipped_and_free_of_special_ids(tmp_path) -> None:
    sizes = SIZE_PRESETS["full"]
    a = make_workloads(sizes, 49152, SPECIAL, seed=3)
    b = make_workloads(sizes, 49152, SPECIAL, seed=3)
    assert a["sharegpt"].requests == b["sharegpt"].requests
    assert a["sharegpt"].requests != make_workloads(sizes, 49152, SPECIAL, 4)["sharegpt"].requests
    share = a["sharegpt"].requests
    assert len(share) == 64
    for r in share:
        assert 4 <= len(r.prompt_token_ids) <= 1024 and 4 <= r.max_tokens <= 1024
    # Long tail around the means (~160 prompt, ~340 output tokens).
    mean_prompt = sum(len(r.prompt_token_ids) for r in share) / len(share)
    mean_output = sum(r.max_tokens for r in share) / len(share)
    assert 80 < mean_prompt < 320 and 170 < mean_output < 680
    uniform = a["uniform"].requests
    assert len(uniform) == 32
    assert all(len(r.prompt_token_ids) == 128 and r.max_tokens == 128 for r in uniform)
    shared = a["shared_prefix"]
    assert len(shared.requests) == 64 and len(shared.warm_prefix) == 1024
    assert all(r.prompt_token_ids[:1024] == shared.warm_prefix for r in shared.requests)
    assert all(r.max_tokens == 64 for r in shared.requests)
    ids = {t for w in a.values() for r in w.requests for t in r.prompt_token_ids}
    assert not ids & SPECIAL and max(ids) < 49152
    path = tmp_path / "t.json"
    save_trace(a["sharegpt"], path)
    assert load_trace(path, 49152).requests == share
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        load_trace(path, 100)


def test_report_math_on_synthetic_steps() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile([], 50) is None
    # (wall, schedule, prepare, forward, sample, process, prompt tokens, generated tokens)
    prefill = [1.0, 0.1, 0.1, 0.7, 0.05, 0.05, 64, 4]
    decode = [[0.2, 0.01, 0.02, 0.15, 0.01, 0.01, 0, 4]] * 3 + [[0.1, 0, 0, 0.1, 0, 0, 0, 2]]
    out = step_analysis([prefill, *decode], num_requests=4)
    assert out["num_decode_steps"] == 4 and out["decode_batch"] == 4
    assert out["decode_step_s"] == pytest.approx(0.2) and out["full_batch"]
    assert out["breakdown_decode"]["forward"] == pytest.approx(100 * 0.55 / 0.7)
    assert out["breakdown_all"]["overhead"] == pytest.approx(100 * (1 - 1.33 / 1.7))


def test_parse_llama_batched_bench_table() -> None:
    header = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s"]
    values = ["128", "128", "32", "8192", "1.570", "2608.68", "8.455", "484.46", "10.024", "817.2"]
    text = "\n".join(
        [
            "main: n_kv_max = 8192, n_batch = 2048",
            "| " + " | ".join(f"{h:>8}" for h in header) + " |",
            "|" + "|".join("-" * 10 for _ in header) + "|",
            "| " + " | ".join(f"{v:>8}" for v in values) + " |",
        ]
    )
    row = parse_batched_bench(text)
    assert (row["PP"], row["TG"], row["B"]) == (128, 128, 32)
    assert (row["T_PP s"], row["T_TG s"], row["T s"]) == (1.570, 8.455, 10.024)
    with pytest.raises(ValueError, match="no result row"):
        parse_batched_bench("error: model not found")


def test_unknown_engine_is_rejected() -> None:
    with pytest.raises(SystemExit, match="unknown engines"):
        bench_throughput.main(["--engines", "vllm", "--size", "tiny"])


def test_single_workload_is_one_request_at_batch_one(tmp_path, tiny_model) -> None:
    sizes = SIZE_PRESETS["tiny"]
    single = make_workloads(sizes, TINY_VOCAB_SIZE, SPECIAL, 0)["single"]
    assert len(single.requests) == 1
    assert len(single.requests[0].prompt_token_ids) == sizes.single_prompt_len
    assert single.num_output_tokens == sizes.single_output_len
    report = _run(
        tmp_path, tiny_model, "--in-process", "--workloads", "single", "--engines", "pagedattn"
    )
    (row,) = report["results"]
    assert row["workload"] == "single" and row["status"] == "ok"
    assert row["num_output_tokens"] == sizes.single_output_len
    assert 0 < row["ttft_p50_s"] and 0 < row["tpot_p50_s"]


def test_grounded_workload_takes_a_base_models_text_as_is():
    """A tokenizer without a chat template (the packaged Gemma 3 270M is a base model) gets the
    grounded texts encoded as they are: `bench throughput --model gemma3-270m` used to stop
    building its workloads with "this tokenizer has no chat template"."""
    from pagedattn.benchmarks.grounded_texts import GROUNDED_TASKS
    from pagedattn.benchmarks.workloads import make_single_grounded

    class BaseTokenizer:
        chat_template = None

        def encode(self, text):
            return [len(word) for word in text.split()]

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("this tokenizer has no chat template")

    workload = make_single_grounded(BaseTokenizer())
    assert [r.prompt_token_ids for r in workload.requests] == [
        BaseTokenizer().encode(text) for text, _ in GROUNDED_TASKS
    ]


def test_a_model_with_two_kv_cache_groups_gets_the_blocks_both_hold(tmp_path):
    """Gemma 3's sliding-window layers hold blocks in a second KV cache group: the workload's
    blocks counted for one group (auto_num_blocks) were too few, and `bench throughput --model
    gemma3-270m --workloads single` rejected its own prompt."""
    from pagedattn.benchmarks.pagedattn_runner import RunOptions, auto_num_blocks, run_pagedattn
    from pagedattn.benchmarks.workloads import BenchRequest, Workload
    from tests.model.tiny import make_tiny_gemma3

    model = make_tiny_gemma3(tmp_path)
    workload = Workload("single", [BenchRequest(list(range(20, 120)), 8)])
    result = run_pagedattn(RunOptions(model=str(model), threads=1), workload)
    assert result.num_output_tokens == 8
    # both groups hold every block of these short sequences (a window of 4, whole steps)
    assert result.extra["num_blocks"] >= 2 * (auto_num_blocks(workload, 16) - 1)
