"""Fixtures: a real redis-server on a free loopback port, started and stopped by the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A redis-server process on 127.0.0.1:port; stop() ends it (idempotent)."""

    port: int
    process: subprocess.Popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_redis_server(*extra_args: str, port: int | None = None) -> RedisServer:
    """Start redis-server without persistence (on a free port by default); wait for PING."""
    redis = pytest.importorskip("redis")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
    port = free_port() if port is None else port
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(
        [*args, *extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    server = RedisServer(port, process)
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            if client.ping():
                break
        except redis.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server on port {port} did not answer PING")
        time.sleep(0.05)
    client.close()
    return server


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = start_redis_server()
    try:
        yield server
    finally:
        server.stop()
