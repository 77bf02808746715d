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
