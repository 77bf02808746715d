"""A tensor-parallel worker process: ``python -m pagedattn.worker.tp_worker HOST PORT``.

It connects back to the engine (rank 0), receives (config, rank, world_size, group port), loads
its shard, then runs each step it is sent until told to close or until the engine goes away.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Client

import torch

logger = logging.getLogger("pagedattn.worker.tp_worker")

PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    """Leave at once when the engine's process is gone, wherever this process is waiting.

    NOTE: not prctl(PR_SET_PDEATHSIG): that fires when the *thread* that started us exits, and
    an engine built on a pool thread (a Ray Serve replica) would lose its ranks.
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def serve(host: str, port: int, authkey: bytes) -> int:
    from pagedattn.distributed.cpu_bind import bind_process
    from pagedattn.distributed.parallel_state import TensorParallelGroup
    from pagedattn.worker.tp_executor import (
        CLOSE,
        OK,
        TPWorkerRunner,
        rank_config,
        rank_placement,
    )

    parent = os.getppid()
    _exit_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: Ctrl-C reaches the engine; it closes us
    conn = Client((host, port), authkey=authkey)
    config, rank, world_size, group_port, shm_path = conn.recv()
    try:
        cpus, threads = rank_placement(rank, world_size, config.num_threads)
        if cpus:
            bind_process(cpus)
        torch.set_num_threads(threads)
        config = rank_config(config, rank)
        if config.model.device.startswith("cuda"):
            torch.cuda.set_device(config.model.device)
        group = TensorParallelGroup(
            rank,
            world_size,
            group_port,
            timeout_s=config.tp_timeout_s,
            device=config.model.device,
            shm_path=shm_path,
        )
        runner = TPWorkerRunner(config, group)
    except Exception as exc:
        logger.exception("tensor-parallel rank %d failed to start", rank)
        conn.send_bytes(pickle.dumps(f"{exc!r}"))
        return 1
    conn.send_bytes(OK)
    # NOTE: the model's objects move out of the collector's generations, so a full collection
    # in the middle of a step (which every other rank waits out in its next collective) walks
    # only what the steps allocated since.
    gc.freeze()
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:
                return 0
            continue
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return 0
        if data == CLOSE:
            runner.close()
            group.close()
            return 0
        try:
            runner.execute(pickle.loads(data))
            reply = OK
        except Exception as exc:
            logger.exception("tensor-parallel rank %d: the step failed", rank)
            reply = pickle.dumps(f"{exc!r}")
        conn.send_bytes(reply)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    from pagedattn import envs

    key = envs.take_tp_authkey()
    sys.exit(serve(sys.argv[1], int(sys.argv[2]), key))
