"""`serve --data-parallel-size 2 --tensor-parallel-size 2` on a 2-node local Ray cluster.

Each replica reserves one bundle per rank (STRICT_PACK), so with 2 CPUs per node and
`--replica-cpus 1` Ray places one replica, with both its ranks, on each node. The app answers,
drains on SIGTERM, and neither the replicas nor their rank processes outlive it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from tests.entrypoints.server_process import free_port, make_model_dir  # noqa: E402
from tests.serve.test_multi_node import _alive, _replicas, _wait_until  # noqa: E402

STARTUP_TIMEOUT_S = 240.0


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid``."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_tensor_parallel_replicas_on_two_ray_nodes(tmp_path):
    model = make_model_dir(tmp_path)
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
    )
    proc = None
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        node_ids = {node.node_id for node in cluster.list_all_nodes()}
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pagedattn.serve.launch", "--model", str(model),
               "--dtype", "float32", "--num-blocks", "64", "--block-size", "4", "--threads", "1",
               "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "2",
               "--tensor-parallel-size", "2", "--ray-address", cluster.address,
               "--replica-cpus", "1", "--shutdown-timeout", "10",
               "--log-level", "warning"]  # fmt: skip
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

        def reported() -> bool:
            replicas = _replicas(base)
            return len(replicas) == 2 and all("node_id" in s for s in replicas.values())

        _wait_until(reported, "2 replicas reporting", proc, log_path, STARTUP_TIMEOUT_S)
        replicas = _replicas(base)
        assert {stats["node_id"] for stats in replicas.values()} == node_ids
        pids = [stats["pid"] for stats in replicas.values()]
        ranks = [kid for pid in pids for kid in _children(pid)]
        assert len(ranks) == 2, ranks  # one rank process beside each replica (rank 0)
        for i in range(4):
            body = {"model": model.name, "prompt": f"the a of to and is in {i}", "max_tokens": 3}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60.0)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log_path.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in pids + ranks) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not any(_alive(pid) for pid in pids + ranks), "a replica or rank outlived the app"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
        cluster.shutdown()
