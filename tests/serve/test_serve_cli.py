"""`serve --data-parallel-size 2` as a process: rank-offset event ports, SIGTERM drains, exit 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("ray")

import zmq  # noqa: E402

from pagedattn.distributed.kv_events import BlockStored, decode_batch  # noqa: E402
from tests.entrypoints.server_process import free_port, make_model_dir  # noqa: E402

STARTUP_TIMEOUT_S = 300.0


def test_replicas_process_publishes_per_rank_and_drains_on_sigterm(tmp_path):
    model = make_model_dir(tmp_path)
    port = free_port()
    # NOTE: a host address (no wildcard) makes each replica connect to it (vLLM's rule); the test
    # binds SUB sockets for ranks 0 and 1 on loopback ports P and P + 1.
    ctx = zmq.Context.instance()
    subs: list[zmq.Socket] = []
    events_port = 0
    while len(subs) < 2:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        try:
            sub.bind(f"tcp://127.0.0.1:{free_port() if not subs else events_port + 1}")
        except zmq.ZMQError:
            sub.close(linger=0)
            for s in subs:
                s.close(linger=0)
            subs = []
            continue
        if not subs:
            events_port = int(sub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        subs.append(sub)
    cmd = [sys.executable, "-m", "pagedattn.serve.launch", "--model", str(model),
           "--dtype", "float32", "--num-blocks", "64", "--block-size", "4", "--threads", "1",
           "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "2",
           "--replica-cpus", "0.5", "--log-level", "warning",
           "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}"]  # fmt: skip
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "replicas not healthy in time"
            for sub in subs:
                # NOTE: a bound socket attaches a peer that connected (and sends it our
                # subscription) only when this thread calls into it; the replicas' PUB drops
                # everything until then.
                sub.poll(0)
            try:
                if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # Replica i publishes to the endpoint's port + i; between them they stored our prompt.
        # NOTE: a replica's PUB may attach after its first events (ZMQ drops what is sent before
        # the subscription arrives), and a repeated prompt stores no new block: so each try sends
        # a prompt not seen before, until events arrive (bounded).
        words = "the a of to and is in it you that he was for on are with as his they be".split()
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 30
        attempt = 0
        while not stored and time.monotonic() < deadline:
            prompt = " ".join(words[attempt % len(words) :] + words[: attempt % len(words)])
            body = {"model": model.name, "prompt": prompt, "max_tokens": 2}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60.0)
            assert r.status_code == 200, r.text
            attempt += 1
            poll_until = time.monotonic() + 1.0
            while time.monotonic() < poll_until:
                for rank, sub in enumerate(subs):
                    while sub.poll(50):
                        topic, _, payload = sub.recv_multipart()
                        batch = decode_batch(payload)
                        assert topic == b"kv-events" and batch.data_parallel_rank == rank
                        stored += [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored and stored[0].block_size == 4
        # The external feed keeps vLLM's schema: token ids included (the router's has none).
        assert len(stored[0].token_ids) == 4 * len(stored[0].block_hashes) > 0
        # SIGTERM while a request runs: it completes, then the process exits 0.
        long_body = dict(body, max_tokens=150, ignore_eos=True)
        result: dict = {}

        def send() -> None:
            result["r"] = httpx.post(f"{base}/v1/completions", json=long_body, timeout=120.0)

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        sender.join(120)
        assert result["r"].status_code == 200, result["r"].text
        assert result["r"].json()["usage"]["completion_tokens"] == 150
        assert proc.wait(120) == 0
    finally:
        for sub in subs:
            sub.close(linger=0)
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
