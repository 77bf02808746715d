"""Embeddings of the served model: LLM.embed and /v1/embeddings (the official client).

The pooled vector is the model's own final hidden state: its LM-head argmax is the token greedy
generation picks; chunked prefill, batching and the prefix cache do not change it.
"""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest
import torch

from pagedattn import LLM, SamplingParams
from pagedattn.entrypoints.openai.server import build_app
from tests.entrypoints.server_process import InProcessServer

MODEL = "smollm2"
# Two runs of one text (different chunking, batching or cache hits) agree at least this much;
# different texts (below) are far below it.
MIN_COSINE = 0.999
TEXTS = [
    "The cat sat on the mat and looked out of the window at the birds in the garden.",
    "A kitten rests on a rug.",
    "Stock markets fell sharply today.",
]


@pytest.fixture(scope="module")
def llm():
    # NOTE: 16-token steps: the first text's prefill runs in several chunks.
    return LLM(dtype="float32", num_blocks=64, block_size=16, max_model_len=512,
               max_num_batched_tokens=16)  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return LLM(dtype="float32", num_blocks=64, block_size=16, max_model_len=512)


def _vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Row by row the same vectors, to the noise of GGUF's kernels: a step of few rows runs with
    int8 activations and a long prefill on dequantised tiles, so the chunking, batching and
    prefix-cache hits of a run move the vector a little (cosine 0.9998 on SmolLM2)."""
    assert got.shape == want.shape
    cos = torch.nn.functional.cosine_similarity(
        got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]), dim=-1
    )
    assert bool((cos > MIN_COSINE).all()), cos


def test_last_token_vector_is_the_hidden_state_the_lm_head_reads(llm):
    raw = llm.embed(TEXTS[0], normalize=False)[0].outputs.embedding
    logits = llm.engine.runner.model.compute_logits(torch.tensor([raw]))
    greedy = llm.generate(TEXTS[0], SamplingParams(max_tokens=1, temperature=0))[0]
    assert int(logits.argmax()) == greedy.outputs[0].token_ids[0]
    normed = llm.embed(TEXTS[0])[0].outputs.embedding
    assert math.isclose(sum(x * x for x in normed), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_batched_and_cached_runs_agree_with_one_plain_run(llm, reference, pooling):
    chunked = _vectors(llm.embed(TEXTS, pooling=pooling))
    plain = _vectors([reference.embed(t, pooling=pooling)[0] for t in TEXTS])
    _assert_same(chunked, plain)
    # the first text's blocks are now in the prefix cache (generate caches them)
    llm.generate(TEXTS[0], SamplingParams(max_tokens=1))
    again = _vectors(llm.embed(TEXTS[0], pooling=pooling))
    _assert_same(again[0], plain[0])
    similar = chunked @ chunked.T
    assert similar[0, 1] > similar[0, 2] and similar[1, 0] > similar[1, 2]
    assert float(similar.max() - similar.diagonal().max()) < 1e-6
    assert float(similar[0, 1]) < MIN_COSINE  # different texts are told apart


def test_dimensions_cut_then_normalise(llm):
    full = llm.embed(TEXTS[1], normalize=False)[0].outputs.embedding
    cut = llm.embed(TEXTS[1], dimensions=32)[0].outputs.embedding
    norm = math.sqrt(sum(x * x for x in full[:32]))
    assert len(cut) == 32 and all(
        math.isclose(c, f / norm, abs_tol=1e-5) for c, f in zip(cut, full[:32], strict=True)
    )
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(TEXTS[1], dimensions=10_000)


@pytest.fixture(scope="module")
def expected(llm) -> torch.Tensor:
    # NOTE: computed before the server's loop owns the engine.
    return _vectors(llm.embed(TEXTS))


@pytest.fixture(scope="module")
def server(llm, expected):
    srv = InProcessServer(build_app(llm.engine, served_model_name=MODEL))
    yield srv
    srv.stop()


def test_openai_client_embeddings_float_base64_and_token_ids(server, llm, expected):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2]
    got = torch.tensor([d.embedding for d in out.data])
    _assert_same(got, expected)
    assert out.usage.prompt_tokens == sum(len(llm.tokenizer.encode(t)) for t in TEXTS)
    ids = llm.tokenizer.encode(TEXTS[2])
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    _assert_same(torch.tensor(by_ids.data[0].embedding), expected[2])
    body = {"model": MODEL, "input": TEXTS[1], "encoding_format": "base64", "dimensions": 64}
    r = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=60)
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(vector) == 64 and math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "dimensions": 100_000}, 400, "dimensions"),
        ({"input": ""}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": "x", "model": "other"}, 404, "model"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "lora_request": {"lora_name": "a"}}, 400, "lora_request"),
    ],
)
def test_bad_embedding_requests(server, body, status, param):
    r = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
