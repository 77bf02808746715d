"""The Ray Serve ingress serves the agent routes with the single server's handlers.

No Ray instance: the ingress's app is built on a stand-in whose replica handle calls a real
EngineReplica's `generate`/`generate_stream` (on SmolLM2) in this process, so what runs is the
ingress's own code (`forward`, `chat_backend`, the shared guard) and the replica's dispatch.
"""

from __future__ import annotations

import asyncio
import types

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from pagedattn import LLM  # noqa: E402
from pagedattn.engine.async_engine import AsyncLLMEngine  # noqa: E402
from pagedattn.entrypoints.openai.http import TenantAuth  # noqa: E402
from pagedattn.entrypoints.openai.serving import OpenAIServing  # noqa: E402
from pagedattn.entrypoints.openai.worker_pool import WorkerPool  # noqa: E402
from pagedattn.serve.replica import EngineReplica  # noqa: E402
from pagedattn.serve.serve_app import OpenAIIngress, build_ingress_app  # noqa: E402
from tests.entrypoints.server_process import InProcessServer  # noqa: E402

MODEL = "smollm2"
KEY = "sk-ingress"


class _Call:
    """A Ray response stand-in: awaitable, cancellable."""

    def __init__(self, coro) -> None:
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()


class _StreamCall:
    """A streaming Ray response stand-in: an async iterator with cancel()."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


class _Handle:
    def __init__(self, replica, stream: bool = False) -> None:
        self.replica, self.stream = replica, stream

    def __getattr__(self, name):
        method = getattr(EngineReplica, name)
        wrap = _StreamCall if self.stream else _Call
        return types.SimpleNamespace(remote=lambda *a, **k: wrap(method(self.replica, *a, **k)))


@pytest.fixture(scope="module")
def server():
    llm = LLM(dtype="float32", num_blocks=64, block_size=16, max_model_len=512)
    engine = AsyncLLMEngine(llm.engine)
    replica = types.SimpleNamespace(
        serving=OpenAIServing(engine, MODEL, enable_auto_tool_choice=True)
    )
    replica._create = types.MethodType(EngineReplica._create, replica)

    async def no_check(*_):
        return None

    ingress = types.SimpleNamespace(
        auth=TenantAuth([KEY]),
        max_request_bytes=1 << 20,
        metrics_public=False,
        engine=_Handle(replica),
        stream_engine=_Handle(replica, stream=True),
        route_pool=WorkerPool("test-route", 1),
        check_prompt=no_check,
        routing_hashes=lambda *_: [],
        trace_hops=False,
    )
    for name in ("forward", "chat_backend"):
        setattr(ingress, name, types.MethodType(getattr(OpenAIIngress, name), ingress))
    srv = InProcessServer(build_ingress_app(ingress))
    yield srv
    srv.stop()
    engine.shutdown()
    ingress.route_pool.close()


def test_agent_routes_on_the_ingress(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/tokenize", "/detokenize", "/v1/embeddings", "/v1/responses"):
        r = httpx.post(f"{server.base_url}{path}", content=b"{}", timeout=10)
        assert r.status_code == 401, (path, r.text)  # the key is checked first
    r = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello"}, headers=auth)
    tokens = r.json()["tokens"]
    r = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, headers=auth)
    assert r.json() == {"prompt": "Hello"}
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    emb = client.embeddings.create(model=MODEL, input=["a", "b"], encoding_format="float")
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 576
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert first.output_text
    events = list(
        client.responses.create(
            model=MODEL, input="And?", previous_response_id=first.id, max_output_tokens=4,
            stream=True, temperature=0,
        )
    )  # fmt: skip
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", max_output_tokens=4, top_p=0)
    assert err.value.body["param"] == "top_p"
