"""The /dashboard of a real `pagedattn serve` process in headless Chromium: requests show up live.

The page loads with every block free; while clients keep sending requests, a second load of the
page shows block tables of running requests and owned blocks, read from the engine's /debug/kv.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.entrypoints.server_process import ServerProcess, make_model_dir, wait_idle
from tests.entrypoints.test_dashboard_browser import CHROMIUM, DomSummary, chromium

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH")
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def live_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dash")
    server = ServerProcess(
        make_model_dir(tmp),
        tmp / "server.log",
        "--num-blocks",
        str(NUM_BLOCKS),
        "--block-size",
        "4",
    )
    yield server
    assert server.stop() == 0


def test_dashboard_of_a_running_server_follows_requests(live_server):
    url = f"{live_server.base_url}/dashboard"
    idle = DomSummary(chromium(url, "--dump-dom"))
    assert idle.num_polls >= 1
    assert len(idle.cells) == NUM_BLOCKS
    assert set(idle.cells.values()) <= {"free", "cached"}
    assert idle.tables == {}

    stop = threading.Event()

    def keep_sending() -> None:
        with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
            while not stop.is_set():
                client.post(
                    "/v1/completions",
                    json={
                        "model": client.get("/v1/models").json()["data"][0]["id"],
                        "prompt": "the a the a the a the a",
                        "max_tokens": 200,
                        "ignore_eos": True,
                    },
                )

    senders = [threading.Thread(target=keep_sending) for _ in range(3)]
    for t in senders:
        t.start()
    try:
        # NOTE: a loaded machine can let one page load fall between two requests' lifetimes;
        # the page must show a running request's table in one of a few loads while they run.
        for _ in range(3):
            busy = DomSummary(chromium(url, "--dump-dom", budget_ms=5000))
            if busy.tables:
                break
    finally:
        stop.set()
        for t in senders:
            t.join(timeout=60)
    assert busy.tables, "no running request's block table appeared on the page"
    shown = {b for table in busy.tables.values() for b in table}
    assert any(busy.cells[b] in ("owned", "shared") for b in shown)
    assert wait_idle(live_server.base_url)["pagedattn_kv_cache_usage_perc"] == 0
