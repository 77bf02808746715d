"""Per-replica CPU sets: replicas that share a node each run on cores of their own.

Each replica of an application gets a slot (its deployment's offset plus its Ray Serve rank:
co-located replicas 0..N-1; PD's prefill replicas first, then its decode replicas). With
``auto`` (the default, like vLLM's ``VLLM_CPU_OMP_THREADS_BIND=auto``) and ``--threads T``,
slot ``s`` binds every thread of its process to CPUs ``[s*T, (s+1)*T)`` of the CPUs the process
may use, so a replica's steps never share a core with another replica's (the OS would otherwise
time-share them: a long prefill would slow the decode steps of its neighbour). When the slots do
not fit (``(s+1)*T`` past the CPU count) or the thread count is unknown, nothing is bound.
An explicit list, ``"0-3|4-7"``, gives slot ``s`` the ``s``-th CPU set; ``off`` binds nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

AUTO, OFF = "auto", "off"


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r} is invalid: use e.g. 0-3,8") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU range {part!r} is invalid: use first-last with first <= last")
        cpus += range(first, last + 1)
    if not cpus:
        raise ValueError(f"CPU list {text!r} is empty: use e.g. 0-3,8")
    return cpus


def parse_cpu_bind(value: str | None) -> str | list[list[int]]:
    """``auto`` (also empty), ``off`` (also 0/none), or one CPU list per slot (``0-3|4-7``)."""
    text = (value or AUTO).strip().lower()
    if text in ("", AUTO):
        return AUTO
    if text in (OFF, "0", "none", "false", "no"):
        return OFF
    return [parse_cpu_list(part) for part in text.split("|")]


def slot_cpus(
    bind: str | list[list[int]], slot: int, num_threads: int | None, allowed: Sequence[int]
) -> list[int] | None:
    """The CPUs of replica slot ``slot``, or None (leave the process as it is)."""
    if bind == OFF or slot < 0:
        return None
    if isinstance(bind, list):
        return list(bind[slot]) if slot < len(bind) else None
    allowed = sorted(allowed)
    if not num_threads or (slot + 1) * num_threads > len(allowed):
        return None
    return allowed[slot * num_threads : (slot + 1) * num_threads]


def bind_process(cpus: Sequence[int]) -> int:
    """Bind every thread of this process (Ray's, the event loop's, any started later) to cpus;
    returns how many threads were bound.

    NOTE: sched_setaffinity(0) binds only the calling thread; threads inherit their creator's
    set, so each thread alive now is bound by its id.
    """
    cpus = set(cpus)
    num_bound = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            num_bound += 1
        except (ProcessLookupError, FileNotFoundError):
            continue  # NOTE: the thread ended meanwhile
    os.sched_setaffinity(0, cpus)
    return max(num_bound, 1)


def renice_process(nice: int) -> int | None:
    """Raise the nice value of every thread of this process (and so of the threads they start)
    to nice; returns the calling thread's nice value after, or None where it was refused.

    NOTE: Linux nice values are per thread and inherited at creation; raising one needs no
    privilege (lowering does).
    """
    for task in Path("/proc/self/task").iterdir():
        try:
            if os.getpriority(os.PRIO_PROCESS, int(task.name)) < nice:
                os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
        except (ProcessLookupError, FileNotFoundError):
            continue  # NOTE: the thread ended meanwhile
        except PermissionError:
            logger.info("nice %d refused; this replica runs at normal priority", nice)
            return None
    return os.getpriority(os.PRIO_PROCESS, 0)


def bind_to_slots(
    bind: str | list[list[int]] | None, slots: Sequence[int], num_threads: int | None
) -> list[int] | None:
    """Bind this process (not a replica: the PD ingress) to the CPUs of every slot in slots;
    the CPUs, or None (nothing bound) when a slot has none."""
    if bind is None or not slots:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    sets = [slot_cpus(bind, slot, num_threads, allowed) for slot in slots]
    if any(cpus is None for cpus in sets):
        return None
    cpus = sorted({cpu for cpus in sets for cpu in cpus})
    bind_process(cpus)
    logger.info("bound to the CPUs of slots %s: %s", list(slots), cpus)
    return cpus


def bind_replica(bind: str | list[list[int]] | None, slot: int, num_threads: int | None):
    """Bind this replica process to its slot's CPUs (see the module doc); the CPUs, or None."""
    if bind is None:
        return None
    cpus = slot_cpus(bind, slot, num_threads, sorted(os.sched_getaffinity(0)))
    if cpus is None:
        if bind == AUTO and num_threads:
            logger.info(
                "replica slot %d: no free CPUs for %d threads; not bound", slot, num_threads
            )
        return None
    bind_process(cpus)
    logger.info("replica slot %d: bound to CPUs %s", slot, cpus)
    return cpus
