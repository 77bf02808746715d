"""The ranks of one tensor-parallel model: a torch.distributed process group and its collectives.

The group is a value each rank holds (no global default group), so several engines can live in
one process and a test can build and drop them. Gloo on CPU, NCCL on CUDA; every collective has
the group's timeout, so a rank whose peer died raises instead of waiting forever.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from pagedattn.distributed.shm_all_reduce import ShmAllReduce

# Gloo cannot all-reduce bfloat16 (nor float16): such tensors are reduced in float32.
_GLOO_REDUCE_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died or the ranks fell out of step."""


class TensorParallelGroup:
    """Rank ``rank`` of ``world_size`` ranks that each hold a shard of one model.

    ``collective_seconds`` and ``num_collectives`` add up the time spent in (and the number of)
    all-reduces and gathers since the last ``reset_counters`` (the bench's per-step numbers).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        port: int,
        *,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
        device: torch.device | str = "cpu",
        shm_path: str | None = None,
    ) -> None:
        """``shm_path``: all-reduce through this shared-memory file (ranks on one x86 machine,
        CPU tensors; distributed.shm_all_reduce) instead of gloo; rank 0 creates it."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self._abort_reason: str | None = None
        self.shm: ShmAllReduce | None = None
        if shm_path is not None and rank == 0:
            self.shm = self._open_shm(shm_path, create=True)
        # NOTE: rank 0 hosts the rendezvous store; the others connect to it (until timeout).
        self.store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True
        )
        prefix = dist.PrefixStore("tp", self.store)
        if self.device.type == "cuda":
            self.backend = "nccl"
            self.pg = dist.ProcessGroupNCCL(prefix, rank, world_size)
        else:
            self.backend = "gloo"
            self.pg = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
        self.collective_seconds = 0.0
        self.num_collectives = 0
        if shm_path is not None:
            if rank != 0:  # NOTE: rank 0 made the file before the store let anyone through
                self.shm = self._open_shm(shm_path, create=False)
            self.barrier()
            if rank == 0:
                self.shm.unlink()  # every rank has it mapped: nothing to leak from here on

    def _open_shm(self, path: str, create: bool) -> ShmAllReduce:
        return ShmAllReduce(
            path,
            self.rank,
            self.world_size,
            create=create,
            timeout_s=self.timeout_s,
            check=self._check_abort,
        )

    @property
    def all_reduce_kind(self) -> str:
        """How all-reduces travel: "shm" or the process group's backend."""
        return "shm" if self.shm is not None else self.backend

    def abort(self, reason: str) -> None:
        """Make every wait of this rank raise CollectiveError (a peer is known dead)."""
        self._abort_reason = reason

    def _check_abort(self) -> None:
        if self._abort_reason is not None:
            raise CollectiveError(self._abort_reason)

    @property
    def is_first(self) -> bool:
        """Whether this is rank 0 (the one that schedules and samples)."""
        return self.rank == 0

    def reset_counters(self) -> None:
        self.collective_seconds, self.num_collectives = 0.0, 0
        if self.shm is not None:
            self.shm.wait_seconds = 0.0

    @property
    def wait_seconds(self) -> float:
        """Of ``collective_seconds``, the shared-memory all-reduces' wait for the last peer
        (load imbalance and preemption, not data movement); 0.0 for gloo, which cannot say."""
        return 0.0 if self.shm is None else self.shm.wait_seconds

    def _wait(self, work, what: str) -> None:
        t0 = time.perf_counter()
        try:
            work.wait()
        except Exception as exc:
            raise CollectiveError(
                f"tensor-parallel {what} failed on rank {self.rank} of {self.world_size} (a peer "
                f"rank died or timed out after {self.timeout_s:.0f} s): {exc}"
            ) from exc
        finally:
            self.collective_seconds += time.perf_counter() - t0
            self.num_collectives += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``x`` over the ranks (in place where the dtype allows)."""
        if self.world_size == 1:
            return x
        if self.shm is not None and x.device.type == "cpu":
            t0 = time.perf_counter()
            try:
                out = self.shm.all_reduce(x if x.is_contiguous() else x.contiguous())
            except TimeoutError as exc:
                msg = f"tensor-parallel all-reduce on rank {self.rank}: {exc}"
                raise CollectiveError(msg) from exc
            self.collective_seconds += time.perf_counter() - t0
            self.num_collectives += 1
            return out
        t = x.contiguous()
        if self.backend == "gloo" and t.dtype not in _GLOO_REDUCE_DTYPES:
            t = t.float()
        t0 = time.perf_counter()
        work = self.pg.allreduce([t])
        self.collective_seconds += time.perf_counter() - t0  # NOTE: gloo runs inline
        self._wait(work, "all-reduce")
        return t if t.dtype == x.dtype else t.to(x.dtype)

    def gather_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the ranks' ``x`` [N, D] concatenated on the last dim [N, world_size * D];
        other ranks: ``x`` itself (they send it and need nothing back)."""
        if self.world_size == 1:
            return x
        if self.shm is not None and x.device.type == "cpu" and x.dim() == 2:
            t0 = time.perf_counter()
            try:
                out = self.shm.gather_first(x)
            except TimeoutError as exc:
                raise CollectiveError(f"tensor-parallel gather on rank {self.rank}: {exc}") from exc
            finally:
                self.collective_seconds += time.perf_counter() - t0
                self.num_collectives += 1
            return x if out is None else out
        t = x.contiguous()
        if self.backend == "nccl":
            # NOTE: NCCL has no gather in ProcessGroupNCCL's python binding of old; all-gather.
            outs = [torch.empty_like(t) for _ in range(self.world_size)]
            self._wait(self.pg.allgather([outs], [t]), "all-gather")
            return torch.cat(outs, dim=-1)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            outs = [torch.empty_like(t) for _ in range(self.world_size)]
            self._wait(self.pg.gather([outs], [t], opts), "gather")
            return torch.cat(outs, dim=-1)
        self._wait(self.pg.gather([], [t], opts), "gather")
        return x

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (so every rank takes the same decision)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.pg.allreduce([t], opts), "all-reduce (min)")
        return int(t.item())

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        self.min_int(0)

    def close(self) -> None:
        """Drop the process group (its sockets close; peers' next collective fails)."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:
                pass
        self.store = None
