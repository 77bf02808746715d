"""The llama.cpp peer's continuous-batching driver, where llama-cpp-python is installed.

`make bench-peers` installs it (a source build); `make test` does not, so there this is skipped.
"""

from __future__ import annotations

import pytest

from pagedattn.benchmarks.pagedattn_runner import PeerUnavailableError, RunOptions
from pagedattn.benchmarks.peers import run_llama_cpp
from pagedattn.benchmarks.workloads import SIZE_PRESETS, make_workloads
from pagedattn.model.loader import packaged_model_path
from tests.model.tiny import make_tiny_llama


def test_llama_cpp_peer_without_a_gguf_says_why(tmp_path):
    # Either llama-cpp-python is missing or the model is an HF folder: skipped with a reason.
    model = make_tiny_llama(tmp_path)
    workload = make_workloads(SIZE_PRESETS["tiny"], 1000, {0}, seed=0)["uniform"]
    with pytest.raises(PeerUnavailableError, match="llama"):
        run_llama_cpp(RunOptions(model=str(model)), workload)


def test_llama_cpp_peer_generates_every_requested_token():
    pytest.importorskip("llama_cpp")
    workloads = make_workloads(SIZE_PRESETS["tiny"], 49152, set(range(17)), seed=0)
    opts = RunOptions(model=str(packaged_model_path("smollm2-135m")), hf_batch_size=3)
    for name in ("uniform", "sharegpt"):
        workload = workloads[name]
        result = run_llama_cpp(opts, workload)
        # More requests than slots: sequences finish and free their slot for the next one.
        assert len(workload.requests) > opts.hf_batch_size
        assert result.num_output_tokens == sum(r.max_tokens for r in workload.requests)
        assert len(result.ttft_s) == len(workload.requests) and min(result.ttft_s) > 0
        assert "continuous batching over 3 sequences" in result.extra["note"]
    assert "weights F32, dequantised from the GGUF" in result.extra["note"]


def test_llama_cpp_on_the_retyped_gguf_generates_the_engines_greedy_tokens():
    # Same numbers, same dtype: llama.cpp's float32 run and ours agree token for token.
    llama_cpp = pytest.importorskip("llama_cpp")
    from pagedattn import LLM, SamplingParams
    from pagedattn.benchmarks.gguf_retype import retyped_gguf

    src = packaged_model_path("smollm2-135m")
    llm = LLM(str(src), dtype="float32", num_threads=2)
    prompt = "The capital of France is Paris. The capital of Germany is"
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    model = llama_cpp.Llama(
        model_path=str(retyped_gguf(src, "float32")), n_ctx=256, n_threads=2, verbose=False
    )
    theirs = []
    for token in model.generate(llm.engine.tokenizer.encode(prompt), temp=0.0, top_k=1):
        theirs.append(token)
        if len(theirs) == 12:
            break
    assert theirs == list(ours.outputs[0].token_ids)


# The child process: default buffer types first, use_extra_bufts off where they crash.

FAKE_CHILD = """
import json, os, signal, sys
job = json.load(open(sys.argv[-2]))
if job.get("crash_when") == job["use_extra_bufts"]:
    os.kill(os.getpid(), signal.SIGSEGV)
result = {"error": "ValueError: bad file"} if job.get("fail") else {"nll": 1.5}
json.dump(result | {"ran_with": job["use_extra_bufts"]}, open(sys.argv[-1], "w"))
"""


@pytest.fixture
def fake_llama_cpp_child(tmp_path, monkeypatch):
    """Children that crash (SIGSEGV) when job["crash_when"] is their use_extra_bufts."""
    import sys

    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(wrapper))


def test_a_crash_with_the_default_buffer_types_runs_again_without(fake_llama_cpp_child):
    from pagedattn.benchmarks.llama_cpp_peer import run_isolated

    result = run_isolated("nll", {"crash_when": True})
    assert result["ran_with"] is False and result["nll"] == 1.5
    assert result["buffer_types"] == "use_extra_bufts off (the default crashed: SIGSEGV)"
    result = run_isolated("nll", {"crash_when": None})
    assert result["ran_with"] is True
    assert result["buffer_types"] == "default (use_extra_bufts on)"


def test_a_crash_asked_for_or_a_python_error_is_not_retried(fake_llama_cpp_child):
    from pagedattn.benchmarks.llama_cpp_peer import run_isolated

    with pytest.raises(RuntimeError, match="crashed: SIGSEGV"):
        run_isolated("nll", {"crash_when": True}, extra_bufts="on")
    assert run_isolated("nll", {}, extra_bufts="off")["buffer_types"] == (
        "use_extra_bufts off (as asked)"
    )
    with pytest.raises(RuntimeError, match="ValueError: bad file"):
        run_isolated("nll", {"fail": True})
