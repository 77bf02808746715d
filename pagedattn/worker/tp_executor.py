"""Tensor parallelism on one machine: rank 0's runner in the engine, one worker process per rank.

One scheduler and one KV cache manager, on rank 0 (the engine's). Each step rank 0 pickles the
``SchedulerOutput`` once and sends it to every worker over a local socket; every rank then runs
the same ``ModelRunner.execute`` on its shard (the same block ids in its own KV caches), meeting
at the collectives; only rank 0 samples. Each worker answers every step (an empty reply, or its
error), so a rank that fails alone is caught at once instead of at the next collective.

A worker is ``python -m pagedattn.worker.tp_worker`` (a fresh interpreter: the user's script is
not imported again, so no ``__main__`` guard is needed). It dies with the engine (parent-death
signal), and a watchdog thread in the engine notices a dead worker: the next step raises
``WorkerFaultError`` (the engine fails its requests and stops) and no rank waits past the
collective timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import platform
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener
from pathlib import Path

import torch

from pagedattn import envs
from pagedattn.config import EngineConfig
from pagedattn.core.scheduler_output import RunnerOutput, SchedulerOutput
from pagedattn.distributed.cpu_bind import (
    AUTO,
    OFF,
    bind_process,
    parse_cpu_bind,
    parse_cpu_list,
    slot_cpus,
)
from pagedattn.distributed.parallel_state import CollectiveError, TensorParallelGroup
from pagedattn.distributed.shm_all_reduce import new_shm_path
from pagedattn.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CLOSE = b"close"
# Seconds the workers get to answer once rank 0's collective has timed out on them.
AFTER_COLLECTIVE_ERROR_S = 1.0
OK = b""


class WorkerFaultError(RuntimeError):
    """A tensor-parallel worker died or fell out of step: the model can no longer run."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def numa_nodes() -> list[list[int]]:
    """The CPUs of each NUMA node of this machine (one list when there is no NUMA info)."""
    nodes = []
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist")):
        text = path.read_text().strip()
        if text:  # NOTE: a node with memory and no CPUs lists none
            nodes.append(parse_cpu_list(text))
    return nodes or [sorted(os.sched_getaffinity(0))]


def rank_placement(
    rank: int, world_size: int, num_threads: int | None, bind: str | list[list[int]] | None = None
) -> tuple[list[int], int]:
    """(CPUs to bind to, torch threads) of ``rank``; ``num_threads`` (--threads) wins where
    given. On a multi-node machine: node ``rank % nodes`` (vLLM's one rank per NUMA node). On one
    node: an equal share of this process's CPUs, and CPUs of its own as replicas get them
    (``bind``, default PAGEDATTN_CPU_BIND; cpu_bind.slot_cpus with the rank as the slot): with
    ``auto``, rank r runs on the r-th run of ``threads`` CPUs when every rank's run fits, so no
    two ranks time-share a core (a rank the OS puts beside its peer makes every other rank wait
    in the next all-reduce). ``off`` binds nothing; [] means "leave the process as it is"."""
    bind = parse_cpu_bind(envs.PAGEDATTN_CPU_BIND) if bind is None else bind
    nodes = numa_nodes()
    if len(nodes) > 1:
        cpus = nodes[rank % len(nodes)]
        return ([] if bind == OFF else cpus), num_threads or len(cpus)
    allowed = sorted(os.sched_getaffinity(0))
    threads = num_threads or max(1, len(allowed) // world_size)
    if bind == AUTO and world_size * threads > len(allowed):
        return [], threads  # NOTE: not every rank fits: none is bound
    return slot_cpus(bind, rank, threads, allowed) or [], threads


class TPWorkerRunner(ModelRunner):
    """A rank other than 0: runs the forward on its shard and samples nothing."""

    def sample(self, logits: torch.Tensor, rows: list) -> RunnerOutput:
        return RunnerOutput()


class TPDriverRunner(ModelRunner):
    """Rank 0: a ModelRunner that starts the workers and hands them each step's contract."""

    def __init__(self, config: EngineConfig) -> None:
        world_size = config.tensor_parallel_size
        self.timeout_s = config.tp_timeout_s
        port = free_port()
        shm_path = group_shm_path(config)
        authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._fault: str | None = None
        self._closed = False
        self._unbound_cpus: list[int] | None = None  # what close() restores (rank 0 bound)
        self.pickle_seconds = 0.0
        try:
            for rank in range(1, world_size):
                self._procs.append(_start_worker(self._listener.address, authkey))
                conn = self._accept()
                conn.send((config, rank, world_size, port, shm_path))
                self._conns.append(conn)
            cpus, threads = rank_placement(0, world_size, config.num_threads)
            if cpus:
                # NOTE: rank 0 is the caller's process (an LLM in a script): close() unbinds it.
                self._unbound_cpus = sorted(os.sched_getaffinity(0))
                bind_process(cpus)
            torch.set_num_threads(threads)
            group = TensorParallelGroup(
                0,
                world_size,
                port,
                timeout_s=self.timeout_s,
                device=rank_config(config, 0).model.device,
                shm_path=shm_path,
            )
            super().__init__(rank_config(config, 0), group)
            for rank, conn in enumerate(self._conns, start=1):
                reply = self._recv(conn, rank, self.timeout_s)
                if reply != OK:
                    raise WorkerFaultError(f"tensor-parallel rank {rank} failed to start: {reply}")
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def _accept(self) -> Connection:
        # NOTE: Listener.accept has no timeout: wait for the socket first.
        sock = self._listener._listener._socket
        sock.settimeout(self.timeout_s)
        try:
            return self._listener.accept()
        except TimeoutError as exc:
            raise WorkerFaultError(
                f"a tensor-parallel worker did not connect within {self.timeout_s:.0f} s"
            ) from exc

    def _recv(self, conn: Connection, rank: int, timeout: float) -> bytes:
        """A worker's reply: OK, or its error text; WorkerFaultError when it dies or stalls."""
        deadline = time.monotonic() + timeout
        proc = self._procs[rank - 1]
        while not conn.poll(0.05):
            if proc.poll() is not None:
                raise WorkerFaultError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                    f"{proc.returncode}"
                )
            if time.monotonic() > deadline:
                raise WorkerFaultError(f"tensor-parallel rank {rank} did not answer in {timeout} s")
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise WorkerFaultError(f"tensor-parallel rank {rank} hung up: {exc!r}") from exc
        return data if data == OK else pickle.loads(data)

    def _watch(self) -> None:
        """Notice a worker that dies (also between steps), for the next step to fail fast."""
        while not self._closed:
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None and not self._closed and self._fault is None:
                    self._fault = f"tensor-parallel rank {rank} exited with code {proc.returncode}"
                    logger.error("%s: the engine cannot run the model any more", self._fault)
                    if getattr(self, "parallel", None) is not None:
                        self.parallel.abort(self._fault)
            time.sleep(0.2)

    def check_health(self) -> None:
        """Raise `WorkerFaultError` once the watchdog has seen a rank die, even while idle."""
        if self._fault is not None:
            raise WorkerFaultError(self._fault)

    @property
    def collective_seconds(self) -> float:
        return self.parallel.collective_seconds

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if self._fault is not None:
            raise WorkerFaultError(self._fault)
        t0 = time.perf_counter()
        payload = pickle.dumps(scheduler_output, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as exc:
            self._fault = f"sending the step to a tensor-parallel worker failed: {exc!r}"
            raise WorkerFaultError(self._fault) from exc
        self.pickle_seconds += time.perf_counter() - t0
        error: Exception | None = None
        try:
            output = super().execute(scheduler_output)
        except Exception as exc:
            error = exc
        # NOTE: rank 0's collective already waited the peers out (--tp-timeout-s): a rank that
        # has not answered by then is hung, and waiting the timeout again would double it.
        wait_s = self.timeout_s
        if isinstance(error, CollectiveError):
            wait_s = min(self.timeout_s, AFTER_COLLECTIVE_ERROR_S)
        replies = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                replies.append(self._recv(conn, rank, wait_s))
            except WorkerFaultError as exc:
                self._fault = str(exc)
                if error is not None:
                    logger.error("tensor-parallel rank 0 failed in the same step: %r", error)
                raise WorkerFaultError(self._fault) from error
        if error is None and all(r == OK for r in replies):
            return output
        if error is not None and all(r != OK for r in replies):
            raise error  # NOTE: every rank failed alike (deterministic): still in step
        self._fault = (
            f"the tensor-parallel ranks fell out of step: rank 0 {error!r}, workers {replies}"
        )
        raise WorkerFaultError(self._fault) from error

    def close(self) -> None:
        """Stop the workers (they exit after their current step) and drop the group."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(CLOSE)
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._listener.close()
        if getattr(self, "parallel", None) is not None:
            self.parallel.close()
        if self._unbound_cpus is not None:
            bind_process(self._unbound_cpus)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config of ``rank``: on CUDA, its own device (cuda:0 + rank); on CPU, unchanged."""
    device = config.model.device
    if not device.startswith("cuda"):
        return config
    first = int(device.partition(":")[2] or 0)
    model = dataclasses.replace(config.model, device=f"cuda:{first + rank}")
    return dataclasses.replace(config, model=model)


def group_shm_path(config: EngineConfig) -> str | None:
    """A new shared-memory file for the all-reduce, or None where gloo (or NCCL) does it."""
    use = config.tp_all_reduce == "shm" and config.model.device == "cpu"
    if not use or platform.machine().lower() not in ("x86_64", "amd64"):
        return None  # NOTE: the flag protocol relies on x86's ordered stores
    return str(new_shm_path())


def _start_worker(address: tuple[str, int], authkey: bytes) -> subprocess.Popen:
    env = dict(os.environ)
    # NOTE: the authkey travels in the environment, not on the command line (ps shows that).
    env["PAGEDATTN_TP_AUTHKEY"] = authkey.hex()
    return subprocess.Popen(
        [sys.executable, "-m", "pagedattn.worker.tp_worker", address[0], str(address[1])],
        env=env,
        stdin=subprocess.DEVNULL,
    )


def make_model_runner(config: EngineConfig) -> ModelRunner:
    """The engine's runner: a plain ModelRunner, or rank 0 of a tensor-parallel model."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    return TPDriverRunner(config)
