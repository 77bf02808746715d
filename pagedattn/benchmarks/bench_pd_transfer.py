"""Block transfer between two processes: ZMQ pull (BlockServer) against Ray's object store.

    pagedattn bench pd-transfer [--tokens 4096] [--block-size 16] [--layers 30] [--kv-heads 3]
                                [--head-size 64] [--dtype-bytes 4] [--repeats 3] [--no-ray]

The transfer is a prompt's encoded blocks (the default: a 4,096-token prompt of the default model,
SmolLM2-135M, float32 KV: 189 MB). ZMQ: a child process serves the blocks from its outbox on a
ROUTER socket and this process pulls them into an inbox (``pull_into``, what a decode replica
does). Ray: an actor holds the blocks and this process gets them (a list of bytes, and one numpy
array, which Ray hands over through shared memory). Prints bytes/s of each (best of --repeats).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np


def _values(num_blocks: int, value_bytes: int) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {f"k{i}": rng.bytes(value_bytes) for i in range(num_blocks)}


def _serve(num_blocks: int, value_bytes: int, conn) -> None:
    from pagedattn.kv_transfer.direct import BlockServer
    from pagedattn.kv_transfer.memory_store import MemoryKVStore

    store = MemoryKVStore(1 << 40)
    for key, value in _values(num_blocks, value_bytes).items():
        store.put(key, value)
    server = BlockServer(store)
    conn.send(server.endpoint)
    conn.recv()  # NOTE: serve until the parent is done
    server.close()


def measure_zmq(num_blocks: int, value_bytes: int, repeats: int) -> float:
    """Best seconds of one pull of num_blocks values through BlockServer / pull_into."""
    # NOTE: imported by name: a spawned child cannot find functions of a runpy'd __main__
    from pagedattn.benchmarks.bench_pd_transfer import _serve
    from pagedattn.kv_transfer.direct import pull_into
    from pagedattn.kv_transfer.memory_store import MemoryKVStore

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(num_blocks, value_bytes, child), daemon=True)
    proc.start()
    try:
        endpoint = parent.recv()
        keys = [f"k{i}" for i in range(num_blocks)]
        best = float("inf")
        for _ in range(repeats):
            inbox = MemoryKVStore(1 << 40)
            num, num_bytes, seconds = pull_into(inbox, endpoint, keys, timeout_s=60.0)
            assert num == num_blocks and num_bytes == num_blocks * value_bytes
            best = min(best, seconds)
        return best
    finally:
        parent.send("stop")
        proc.join(timeout=10)


def measure_ray(num_blocks: int, value_bytes: int, repeats: int) -> dict[str, float]:
    """Best seconds of ray.get of the values from an actor: as a list of bytes, as one array."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Holder:
            def __init__(self) -> None:
                self.values = _values(num_blocks, value_bytes)

            def get(self, keys):
                return [self.values[k] for k in keys]

            def get_array(self, keys):
                return np.frombuffer(b"".join(self.values[k] for k in keys), dtype=np.uint8)

        holder = Holder.remote()
        keys = [f"k{i}" for i in range(num_blocks)]
        ray.get(holder.get.remote(keys[:1]))
        out = {}
        for method in ("get", "get_array"):
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                got = ray.get(getattr(holder, method).remote(keys))
                inbox = dict(zip(keys, got, strict=True)) if method == "get" else got
                best = min(best, time.perf_counter() - start)
                del inbox, got
            out[method] = best
        return out
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--dtype-bytes", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-ray", action="store_true", help="measure ZMQ only")
    args = p.parse_args()
    num_blocks = args.tokens // args.block_size
    value_bytes = 2 * args.layers * args.kv_heads * args.head_size * args.block_size
    value_bytes = value_bytes * args.dtype_bytes + 80  # + header and checksum
    total = num_blocks * value_bytes
    print(f"machine load: {open('/proc/loadavg').read().split()[:3]} ({os.cpu_count()} cpus)")
    print(f"transfer: {num_blocks} blocks x {value_bytes} B = {total / 1e6:.1f} MB")
    zmq_s = measure_zmq(num_blocks, value_bytes, args.repeats)
    print(f"zmq pull       {zmq_s * 1e3:8.1f} ms  {total / zmq_s / 1e9:6.2f} GB/s")
    if not args.no_ray:
        for method, seconds in measure_ray(num_blocks, value_bytes, args.repeats).items():
            name = f"ray {method}"
            print(f"{name:<14} {seconds * 1e3:8.1f} ms  {total / seconds / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
