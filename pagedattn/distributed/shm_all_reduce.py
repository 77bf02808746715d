"""All-reduce between ranks of one machine through a shared-memory file (vLLM CPU's idea).

Gloo over loopback TCP costs about a millisecond per all-reduce on a small host even for one
row; a decode step has two per layer. Here each rank copies its tensor into its own slot of a
mapped file, publishes a sequence number, waits (spinning, then yielding the core) until every
rank has published, and sums the slots in rank order, so every rank gets the same bits.

Two slot sets alternate by sequence parity: a rank writes set ``p`` again only two calls later,
after every peer has published the call in between, i.e. has finished reading set ``p``.

Float32 and bfloat16 tensors go through the compiled extension (csrc/shm_collectives_cpu.cpp:
one call publishes, waits and sums; the Python steps below cost 65-140 us per all-reduce of a
[32, 576] float32 tensor here, the compiled call about a tenth of that). Other dtypes, and
builds without the extension, take the Python steps; both follow the same protocol.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

# One sequence number per rank, each on its own cache line.
_FLAG_STRIDE = 8  # int64s
DEFAULT_SLOT_BYTES = 8 << 20
_SPINS_BEFORE_YIELD = 64
# The compiled call's wait slice: after it, check() runs (a dead peer raises) and waiting resumes.
_COMPILED_WAIT_SLICE_S = 0.5
_COMPILED_DTYPES = (torch.float32, torch.bfloat16)


def _compiled_collectives():
    """The extension when it has the compiled collectives, else None (the Python steps)."""
    from pagedattn.cpu.extension import get_extension

    ext = get_extension()
    return ext if ext is not None and hasattr(ext, "shm_all_reduce") else None


def new_shm_path() -> Path:
    """A fresh file name in /dev/shm (or the temp dir where there is none)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"pagedattn-tp-{uuid.uuid4().hex}"


class ShmAllReduce:
    """The shared-memory all-reduce of rank ``rank`` of ``world_size`` (see the module doc).

    Rank 0 creates the file (``create=True``) before the others open it; once all have mapped
    it, ``unlink`` removes the name (the mappings stay), so nothing is left behind on a crash.
    ``check`` is called while waiting: it raises to abandon the wait (a peer died).
    """

    def __init__(
        self,
        path: str | Path,
        rank: int,
        world_size: int,
        *,
        create: bool,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        timeout_s: float = 60.0,
        check: Callable[[], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.rank, self.world_size = rank, world_size
        self.slot_bytes = slot_bytes
        self.timeout_s = timeout_s
        self.check = check
        header = world_size * _FLAG_STRIDE * 8
        size = header + 2 * world_size * slot_bytes
        if create:
            with open(self.path, "wb") as f:
                f.truncate(size)
        buf = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        self._buf = buf
        self._flags = buf[:header].view(torch.int64).numpy()  # NOTE: numpy reads are ~10x faster
        self._slots = [
            [
                buf[header + (p * world_size + r) * slot_bytes :][:slot_bytes]
                for r in range(world_size)
            ]
            for p in range(2)
        ]
        self._seq = 0
        self.wait_seconds = 0.0  # of the calls' time: waiting for the last peer to arrive
        self._ext = _compiled_collectives()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def _wait_for(self, seq: int) -> None:
        flags, stride = self._flags, _FLAG_STRIDE
        for r in range(self.world_size):
            spins = 0
            deadline = None
            while flags[r * stride] < seq:
                spins += 1
                if spins < _SPINS_BEFORE_YIELD:
                    continue
                os.sched_yield()
                if spins % 1024 == 0:
                    if self.check is not None:
                        self.check()
                    now = time.monotonic()
                    deadline = deadline or now + self.timeout_s
                    if now > deadline:
                        raise TimeoutError(
                            f"shared-memory all-reduce: rank {r} did not arrive in "
                            f"{self.timeout_s:.0f} s"
                        )

    def _exchange(self, chunk: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``chunk`` and wait for every rank's; returns every rank's (slot views)."""
        self._seq += 1
        seq, parity = self._seq, self._seq & 1
        n_bytes = chunk.numel() * chunk.element_size()
        slots = [s[:n_bytes].view(chunk.dtype).view(chunk.shape) for s in self._slots[parity]]
        slots[self.rank].copy_(chunk)
        # NOTE: x86 keeps stores in order: peers that see the flag see the data.
        self._flags[self.rank * _FLAG_STRIDE] = seq
        t0 = time.perf_counter()
        self._wait_for(seq)
        self.wait_seconds += time.perf_counter() - t0
        return slots

    def _compiled(self, op: Callable, *args) -> None:
        """Run one compiled collective (``op(buf, *args, rank, world, seq, ...)``) to the end:
        the first call publishes and waits one slice; later calls (a peer is late) check the
        peers first and go on waiting, for at most timeout_s more."""
        self._seq += 1
        first, deadline = True, 0.0
        while True:
            done, waited = op(
                self._buf, *args, self.rank, self.world_size, self._seq, self.slot_bytes, first,
                _COMPILED_WAIT_SLICE_S,
            )  # fmt: skip
            self.wait_seconds += waited
            if done:
                return
            if first:
                first, deadline = False, time.monotonic() + self.timeout_s
            if self.check is not None:
                self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shared-memory all-reduce: a peer did not arrive in {self.timeout_s:.0f} s"
                )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the ranks, written into ``x`` (contiguous)."""
        compiled = self._ext is not None and x.dtype in _COMPILED_DTYPES
        if compiled and x.numel() * x.element_size() <= self.slot_bytes:
            self._compiled(self._ext.shm_all_reduce, x)  # NOTE: a decode step's: one call
            return x
        flat = x.view(-1)
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            chunk = flat[start : start + step]
            if compiled:
                self._compiled(self._ext.shm_all_reduce, chunk)
                continue
            slots = self._exchange(chunk)
            chunk.copy_(slots[0])
            for s in slots[1:]:
                chunk.add_(s)
        return x

    def gather_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` [N, D] side by side [N, world_size * D]; others: None."""
        x = x.contiguous()
        rows = max(1, self.slot_bytes // max(1, x[0].numel() * x.element_size()))
        out = torch.empty(x.shape[0], self.world_size * x.shape[1], dtype=x.dtype)
        for start in range(0, x.shape[0], rows):
            chunk = x[start : start + rows]
            if self._ext is not None:
                target = out[start : start + rows] if self.rank == 0 else None
                self._compiled(self._ext.shm_gather_first, chunk, target)
                continue
            slots = self._exchange(chunk)
            if self.rank == 0:
                torch.cat(slots, dim=-1, out=out[start : start + rows])
        return out if self.rank == 0 else None
