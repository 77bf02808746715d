"""Issue 21, the front door: one HTTP layer, bounded grammar compiles and prompts, a truthful
/health, and the adversarial probes (scripts/adversarial_probes.py) on the single server.

The Ray Serve ingress runs the same probes in tests/serve/test_serve_app.py.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedattn import LLM
from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.entrypoints.openai import preprocess
from pagedattn.entrypoints.openai.http import error_payload
from pagedattn.entrypoints.openai.preprocess import PromptPreprocessor, encode_bounded
from pagedattn.entrypoints.openai.server import build_app
from pagedattn.entrypoints.openai.worker_pool import WorkerPool
from pagedattn.structured_output import compiler
from tests.entrypoints.server_process import InProcessServer, make_model_dir

ROOT = Path(__file__).resolve().parents[2]
KEY_A, KEY_B = "door-key-a", "door-key-b"
MODEL = "tiny"
STALL_S = 0.5


def load_probes():
    spec = importlib.util.spec_from_file_location("probes", ROOT / "scripts/adversarial_probes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("tiny"))
    llm = LLM(str(path), dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
    app = build_app(
        AsyncLLMEngine(llm.engine),
        api_key=[KEY_A, KEY_B],
        served_model_name=MODEL,
        health_stall_s=STALL_S,
        grammar_timeout_s=1.0,
    )
    srv = InProcessServer(app)
    srv.serving = app.state.serving
    yield srv
    srv.stop()


def _post(server, body: dict, key: str = KEY_A) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "max_tokens": 1, **body}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60)


@contextlib.contextmanager
def held(make_jobs):
    """Run ``make_jobs(release)`` (a coroutine whose jobs wait on ``release``) on an event loop
    of its own in a thread while the block runs; then release them and wait for it to end."""
    release = threading.Event()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(make_jobs(release),))
    thread.start()
    try:
        yield
    finally:
        release.set()
        thread.join()
        loop.close()


def test_adversarial_probes_hold_on_the_single_server(server):
    probes = load_probes()
    results = probes.run_probes(server.base_url, KEY_A, MODEL, KEY_B)
    failed = [f"{r.name}: {r.failure}" for r in results if not r.ok]
    assert not failed, failed
    assert len(results) >= 10


# ---- C1: grammar compiles ---------------------------------------------------------------------


def test_grammars_compile_on_their_own_pool_so_text_prompts_go_on(server):
    async def occupy(release) -> None:
        await server.serving.grammar_pool.run(release.wait, 30)

    with held(occupy):
        time.sleep(0.2)
        t0 = time.monotonic()
        assert _post(server, {"prompt": "hello"}).status_code == 200
        assert time.monotonic() - t0 < 5.0
        # NOTE: the compile queued behind the stuck one passes its deadline: 400, not a hang.
        r = _post(server, {"prompt": "pick", "guided_choice": ["yes", "no"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "constraint_timeout", r.text
    # NOTE: the compile itself (the engine's run of a grammar is the sampler's business).
    from pagedattn.structured_output.params import StructuredOutputsParams

    params = StructuredOutputsParams(choice=["yes", "no"])
    asyncio.run(server.serving._compile(params, "guided_choice"))


def test_constraint_size_limits_name_the_limit():
    from pagedattn.structured_output.params import (
        InvalidStructuredOutputsError,
        StructuredOutputsParams,
    )

    too_big = [
        StructuredOutputsParams(choice=[f"c{i}" for i in range(compiler.MAX_CHOICES + 1)]),
        StructuredOutputsParams(regex="a" * (compiler.MAX_REGEX_CHARS + 1)),
        StructuredOutputsParams(json={"enum": ["x" * 50] * 1000}),
        StructuredOutputsParams(grammar="root ::= " + '"a" ' * compiler.MAX_GRAMMAR_CHARS),
    ]
    for params in too_big:
        with pytest.raises(InvalidStructuredOutputsError, match="too large to compile"):
            compiler.check_constraint_size(params)
    compiler.check_constraint_size(StructuredOutputsParams(choice=["yes", "no"]))


def test_a_queued_job_whose_caller_left_never_runs():
    pool = WorkerPool("test", 1)
    release = threading.Event()
    ran = []

    async def main() -> None:
        busy = asyncio.ensure_future(pool.run(release.wait, 30))
        await asyncio.sleep(0.1)
        queued = asyncio.ensure_future(pool.run(ran.append, "ran"))
        await asyncio.sleep(0.1)
        queued.cancel()  # the client disconnected: its compile must not start
        # NOTE: the cancel reaches the executor's future on the loop's next turn; releasing the
        # worker in the same turn let it pick the job first under load (a CI run saw it run).
        await asyncio.sleep(0.05)
        release.set()
        await busy
        await asyncio.sleep(0.2)

    try:
        asyncio.run(main())
    finally:
        pool.close()
    assert ran == []


def test_a_full_queue_is_refused_with_503():
    from pagedattn.entrypoints.openai.protocol import APIError

    pool = WorkerPool("test", 1, max_queued=1)
    release = threading.Event()

    async def main() -> None:
        jobs = [asyncio.ensure_future(pool.run(release.wait, 30)) for _ in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(APIError) as info:
            await pool.run(release.wait, 30)
        assert info.value.status_code == 503
        release.set()
        await asyncio.gather(*jobs)

    try:
        asyncio.run(main())
    finally:
        pool.close()


# ---- H1: prompt limits ------------------------------------------------------------------------


def test_tokenisation_stops_soon_after_max_model_len_tokens():
    encoded = []

    def encode(text: str) -> list[int]:
        encoded.append(len(text))
        return [1] * (len(text) // 3 + 1)

    ids = encode_bounded(encode, "abc" * 1_000_000, max_tokens=100)
    assert len(ids) > 101
    assert sum(encoded) < 10 * 100 * preprocess.PROBE_CHARS_PER_TOKEN  # not 3 MB
    short = encode_bounded(encode, "abc" * 10, max_tokens=100)
    assert len(short) == 11


def test_default_prompt_cap_is_near_what_fits():
    class Tok:
        def get_vocab(self):
            return {"a" * 40: 0, "b": 1}  # one very long token

    pre = PromptPreprocessor(Tok(), max_model_len=1000)
    try:
        assert pre.max_prompt_chars == 1000 * preprocess.DEFAULT_CHARS_PER_TOKEN
    finally:
        pre.close()


def test_a_small_prompt_has_its_own_lane(server):
    pool = server.serving.preprocessor.pool

    async def occupy(release) -> None:
        await asyncio.gather(*(pool.run(release.wait, 30) for _ in range(4)))

    with held(occupy):
        time.sleep(0.2)
        t0 = time.monotonic()
        assert _post(server, {"prompt": "hello"}).status_code == 200
        assert time.monotonic() - t0 < 5.0


# ---- /health, errors, layering ----------------------------------------------------------------


def test_health_is_degraded_while_a_front_end_job_is_stuck(server):
    async def stuck(release) -> None:
        await server.serving.preprocessor.pool.run(release.wait, 30)

    with held(stuck):
        time.sleep(STALL_S + 0.5)
        r = httpx.get(f"{server.base_url}/health")
        assert r.status_code == 503 and r.json()["status"] == "degraded", r.text
        assert "pagedattn-tokenize" in r.json()["reasons"][0]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_health_is_degraded_while_an_engine_step_is_stuck(server):
    engine = server.serving.engine

    async def stuck_step(release) -> None:
        await engine.call(lambda _: release.wait(30))

    with held(stuck_step):
        time.sleep(STALL_S + 0.5)
        r = httpx.get(f"{server.base_url}/health")
        assert r.status_code == 503 and "engine step" in r.json()["reasons"][0], r.text
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_unexpected_errors_never_reach_the_client():
    exc = RuntimeError("actor 8f3a pid=4242 ip=10.1.2.3 /home/user/secret")
    payload = error_payload(exc)
    assert payload["status"] == 500
    text = str(payload["body"])
    assert "10.1.2.3" not in text and "4242" not in text and "error id" in text


def test_metrics_need_a_key_unless_public(server, tmp_path):
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401
    ok = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"})
    assert ok.status_code == 200 and "pagedattn_" in ok.text


def test_the_two_front_doors_do_not_import_each_other():
    def imports(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    server = imports(ROOT / "pagedattn/entrypoints/openai/server.py")
    ingress = imports(ROOT / "pagedattn/serve/serve_app.py")
    assert not any("serve_app" in n for n in server)
    assert not any(n.startswith("pagedattn.entrypoints.openai.server") for n in ingress)
    assert "pagedattn.entrypoints.openai.http" in server & ingress
