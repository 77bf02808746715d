"""`serve --data-parallel-size 2 --ray-address` on a real 2-node Ray cluster on this machine.

Ray's own `ray.cluster_utils.Cluster` starts a head node and a second node (separate raylets,
one CPU each), as Ray's multi-node tests do; `--replica-cpus 1` makes Ray place one replica on
each node. The serve command joins the cluster, answers OpenAI requests through the head's
proxy, and on SIGTERM deletes the application (the replicas' processes exit) and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from tests.entrypoints.server_process import free_port, make_model_dir  # noqa: E402

STARTUP_TIMEOUT_S = 120.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # NOTE: a zombie (exited, not yet reaped by its parent) counts as stopped.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_until(cond, what: str, proc: subprocess.Popen, log_path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"serve exited early:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out: {what}\n{log_path.read_text()[-3000:]}"
        time.sleep(0.5)


def _replicas(base: str) -> dict:
    try:
        r = httpx.get(f"{base}/debug/replicas", timeout=5.0)
    except httpx.HTTPError:
        return {}
    return r.json() if r.status_code == 200 else {}


def test_replicas_on_two_ray_nodes(tmp_path):
    model = make_model_dir(tmp_path)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    proc = None
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below)
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        node_ids = {node.node_id for node in cluster.list_all_nodes()}
        assert len(node_ids) == 2
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pagedattn.serve.launch", "--model", str(model),
               "--dtype", "float32", "--num-blocks", "64", "--block-size", "4", "--threads", "1",
               "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "2",
               "--ray-address", cluster.address, "--replica-cpus", "1",
               "--shutdown-timeout", "10", "--log-level", "warning"]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        log_path = tmp_path / "serve.log"

        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        _wait_until(healthy, "the endpoint answers /health", proc, log_path, STARTUP_TIMEOUT_S)

        # NOTE: a replica is listed before Ray Serve first polls its routing stats (empty until
        # then), so wait until both have reported theirs.
        def reported() -> bool:
            replicas = _replicas(base)
            return len(replicas) == 2 and all("node_id" in s for s in replicas.values())

        _wait_until(reported, "2 replicas reporting routing stats", proc, log_path, 60.0)
        replicas = _replicas(base)
        # One replica per Ray node: the two replicas report two different nodes of this cluster.
        placed = {stats["node_id"] for stats in replicas.values()}
        assert placed == node_ids, (placed, node_ids)
        pids = [stats["pid"] for stats in replicas.values()]
        # Requests are answered through the OpenAI endpoint (both kinds, and a stream).
        for i in range(4):
            body = {"model": model.name, "prompt": f"the a of to and is in {i}", "max_tokens": 3}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60.0)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        chat = {"model": model.name, "messages": [{"role": "user", "content": "the a"}],
                "max_tokens": 2, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=chat, timeout=60.0) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2
        # SIGTERM: the application is deleted (both replicas' processes exit), the command exits 0.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not any(_alive(pid) for pid in pids), "a replica process outlived the app"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
        node_pids = [
            p.process.pid
            for node in cluster.list_all_nodes()
            for infos in node.all_processes.values()
            for p in infos
        ]
        cluster.shutdown()
    # Everything the cluster started is stopped.
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in node_pids) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not any(_alive(pid) for pid in node_pids)
