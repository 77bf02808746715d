"""The /dashboard page in a real headless Chromium: it loads, draws the pool and follows it.

A small FastAPI app serves the page and a /debug/kv backed by a real KVCacheManager; the
request arrives between two polls of the open page. Skipped only when no Chromium is installed
(scripts/setup.sh installs it).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from PIL import Image

import pagedattn
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from pagedattn.core.kv_snapshot import kv_snapshot
from pagedattn.core.request import Request

DASHBOARD = Path(pagedattn.__file__).parent / "entrypoints/openai/static/dashboard.html"
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium binary on PATH (apt-get install chromium; scripts/setup.sh does)",
)
NUM_BLOCKS = 48
# dashboard.html's PALETTE and requestColor(), to find a request's cells in a screenshot.
JS_PALETTE = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#bcbd22",
    "#17becf",
    "#1b9e77",
    "#d95f02",
    "#7570b3",
    "#e7298a",
    "#66a61e",
    "#e6ab02",
    "#a6761d",
    "#666666",
]


def js_request_color(request_id: str) -> tuple[int, int, int]:
    h = 0
    for ch in request_id:
        h = (h * 31 + ord(ch)) % 2**32
    color = JS_PALETTE[h % len(JS_PALETTE)]
    return tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))


class KVServer:
    """/dashboard and /debug/kv over a real manager; ``on_poll(n)`` runs before poll n answers."""

    def __init__(self) -> None:
        self.manager = KVCacheManager(
            [KVCacheGroupSpec(("l0",), FullAttentionSpec(16))], NUM_BLOCKS
        )
        self.requests: dict[str, Request] = {}
        self.num_polls = 0
        self.on_poll: Callable[[int], None] | None = None
        app = FastAPI()
        app.get("/dashboard")(lambda: HTMLResponse(DASHBOARD.read_text()))
        app.get("/debug/kv")(self.debug_kv)
        self.app = app

    def debug_kv(self) -> dict:
        self.num_polls += 1
        if self.on_poll is not None:
            self.on_poll(self.num_polls)
        return kv_snapshot(self.manager, self.requests)

    def admit(self, request_id: str, num_tokens: int) -> list[int]:
        req = Request(request_id, list(range(num_tokens)), block_size=16)
        assert self.manager.allocate_slots(req, num_tokens) is not None
        req.num_computed_tokens = num_tokens
        self.requests[request_id] = req
        return self.manager.get_block_ids(request_id)[0]


@pytest.fixture
def server() -> Iterator[tuple[KVServer, str]]:
    kv = KVServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(kv.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    yield kv, f"http://127.0.0.1:{port}/dashboard"
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def chromium(url: str, *args: str, budget_ms: int = 3000) -> str:
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                f"--virtual-time-budget={budget_ms}",
                *args,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    return out.stdout


class DomSummary(HTMLParser):
    """Block cells (id -> state), block-table rows (request id -> entries), body poll count."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.cells: dict[int, str] = {}
        self.tables: dict[str, list[int]] = {}
        self.num_polls = 0
        self._row: str | None = None
        self._in_entry = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        cls = a.get("class", "")
        if tag == "body":
            self.num_polls = int(a.get("data-polls", 0))
        elif cls == "kv-block":
            self.cells[int(a["data-block-id"])] = a["data-state"]
        elif cls == "block-table":
            self._row = a["data-request-id"]
            self.tables[self._row] = []
        self._in_entry = cls == "table-entry"

    def handle_data(self, data: str) -> None:
        if self._in_entry and self._row is not None:
            self.tables[self._row].append(int(data))
            self._in_entry = False


def test_dashboard_draws_the_pool_and_follows_a_new_request(server, tmp_path) -> None:
    kv, url = server
    idle = DomSummary(chromium(url, "--dump-dom"))
    assert idle.num_polls >= 2  # it keeps polling
    assert idle.cells == {i: "free" for i in range(NUM_BLOCKS)}
    assert idle.tables == {}

    # The request arrives while the page is open: on the page's 3rd poll of this load.
    first_poll = kv.num_polls + 1
    admitted: list[int] = []
    kv.on_poll = lambda n: n == first_poll + 2 and admitted.extend(kv.admit("req-live", 40))
    live = DomSummary(chromium(url, "--dump-dom"))
    assert live.num_polls >= 4 and len(admitted) == 3  # 40 tokens / 16 = 3 blocks
    assert live.tables == {"req-live": admitted}
    assert {i for i, s in live.cells.items() if s == "owned"} == set(admitted)
    assert len(live.cells) == NUM_BLOCKS

    shot = tmp_path / "dashboard.png"
    kv.on_poll = None
    chromium(url, f"--screenshot={shot}", "--window-size=1000,700")
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    owned = np.all(np.abs(pixels - js_request_color("req-live")) <= 2, axis=1).sum()
    assert owned > 3 * 14 * 14  # three 14x14 cells at least, plus the block-table entries
