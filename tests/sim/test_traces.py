"""Trace generators match the paper's length statistics; JSONL round-trips and errors are clear."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedattn.sim.traces import TraceError, generate_trace, load_jsonl, save_jsonl


@pytest.mark.parametrize(
    ("workload", "prompt_mean", "output_mean"), [("sharegpt", 161, 338), ("alpaca", 19, 58)]
)
def test_means_match_the_paper(workload: str, prompt_mean: float, output_mean: float) -> None:
    trace = generate_trace(workload, 20000, max_seq_len=2048, seed=1)
    assert np.mean([r.prompt_len for r in trace]) == pytest.approx(prompt_mean, rel=0.03)
    assert np.mean([r.output_len for r in trace]) == pytest.approx(output_mean, rel=0.03)
    for r in trace:
        assert 1 <= r.output_len <= r.max_tokens and r.prompt_len + r.max_tokens <= 2048


def test_poisson_arrivals_and_seed() -> None:
    a = generate_trace("alpaca", 2000, arrival_rate=0.5, seed=3)
    times = [r.arrival_time for r in a]
    assert times == sorted(times)
    assert times[-1] / len(times) == pytest.approx(2.0, rel=0.1)  # mean gap = 1 / rate
    assert generate_trace("alpaca", 5, seed=3) == generate_trace("alpaca", 5, seed=3)
    assert all(r.arrival_time == 0 for r in generate_trace("alpaca", 5, arrival_rate=math.inf))


def test_jsonl_round_trip_and_defaults(tmp_path) -> None:
    trace = generate_trace("sharegpt", 10, arrival_rate=1.0, seed=0)
    path = tmp_path / "t.jsonl"
    save_jsonl(trace, path)
    assert load_jsonl(path) == trace
    path.write_text('{"prompt_len": 4, "output_len": 7}\n\n')
    (req,) = load_jsonl(path)
    assert (req.prompt_len, req.output_len, req.max_tokens, req.arrival_time) == (4, 7, 7, 0.0)


def test_malformed_trace_names_the_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 4, "output_len": 7}\n{"prompt_len": 4}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2"):
        load_jsonl(path)
    with pytest.raises(TraceError, match="max_tokens"):
        generate_trace("sharegpt", 1)[0].__class__("x", 4, 9, 0.0, 3)
    with pytest.raises(TraceError, match="unknown workload"):
        generate_trace("lmsys", 3)
