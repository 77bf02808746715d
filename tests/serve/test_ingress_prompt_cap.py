"""The Ray Serve ingress lists the vocabulary for its default prompt cap once, off its event loop.

Listing SmolLM2's 49k-token vocabulary takes ~80 ms. Done on the ingress's event loop for every
request, it held every stream's tokens (the PD benchmark's ITL p99, README). No Ray instance:
the method runs on a stand-in for the ingress.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from pagedattn.engine.errors import InvalidRequestError  # noqa: E402
from pagedattn.entrypoints.openai.protocol import CompletionRequest  # noqa: E402
from pagedattn.entrypoints.openai.worker_pool import WorkerPool  # noqa: E402
from pagedattn.serve.serve_app import OpenAIIngress  # noqa: E402


class CountingTokenizer:
    """A vocabulary whose longest token has 5 characters; counts the listings and their threads."""

    def __init__(self) -> None:
        self.threads: list[str] = []

    def get_vocab(self) -> dict[str, int]:
        self.threads.append(threading.current_thread().name)
        return {"a": 0, "hello": 1}


def test_the_default_prompt_cap_is_computed_once_on_a_worker():
    tokenizer = CountingTokenizer()
    pool = WorkerPool("pagedattn-route", 1)
    ingress = SimpleNamespace(
        max_model_len=10,
        max_prompt_chars=None,
        default_prompt_chars=None,
        hasher=SimpleNamespace(tokenizer=tokenizer),
        route_pool=pool,
    )

    async def run() -> None:
        for _ in range(3):
            body = CompletionRequest(model="m", prompt="x" * 50)  # the cap: 10 tokens x 5 chars
            await OpenAIIngress.check_prompt(ingress, "completion", body)
        with pytest.raises(InvalidRequestError, match="51 characters"):
            await OpenAIIngress.check_prompt(
                ingress, "completion", CompletionRequest(model="m", prompt="x" * 51)
            )

    try:
        asyncio.run(run())
    finally:
        pool.close()
    assert ingress.default_prompt_chars == 50
    assert len(tokenizer.threads) == 1
    assert tokenizer.threads[0].startswith("pagedattn-route")
