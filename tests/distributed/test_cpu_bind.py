"""Per-replica CPU sets: slots get disjoint CPUs, and binding covers every thread of a process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pagedattn.distributed.cpu_bind import (
    AUTO,
    OFF,
    parse_cpu_bind,
    parse_cpu_list,
    slot_cpus,
)


def test_parse_cpu_bind():
    assert parse_cpu_bind(None) == AUTO
    assert parse_cpu_bind(" Auto ") == AUTO
    assert parse_cpu_bind("off") == OFF
    assert parse_cpu_bind("0") == OFF
    assert parse_cpu_bind("0-2,5|3") == [[0, 1, 2, 5], [3]]
    assert parse_cpu_list("4") == [4]
    for bad in ("a-b", "3-1", ",", "0|"):
        with pytest.raises(ValueError):
            parse_cpu_bind(bad)


def test_auto_slots_are_disjoint_and_stop_when_they_do_not_fit():
    allowed = [8, 9, 10, 11, 12, 13, 14, 15]
    sets = [slot_cpus(AUTO, slot, 2, allowed) for slot in range(4)]
    assert sets == [[8, 9], [10, 11], [12, 13], [14, 15]]
    assert slot_cpus(AUTO, 4, 2, allowed) is None  # NOTE: would share CPUs: leave it unbound
    assert slot_cpus(AUTO, 0, None, allowed) is None  # thread count unknown
    assert slot_cpus(OFF, 0, 1, allowed) is None
    assert slot_cpus([[3], [1, 2]], 1, 1, allowed) == [1, 2]
    assert slot_cpus([[3]], 1, 1, allowed) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_bind_process_binds_threads_started_before_and_after():
    cpu = min(os.sched_getaffinity(0))
    code = textwrap.dedent(
        f"""
        import os, threading
        from pagedattn.distributed.cpu_bind import bind_process
        started = threading.Event(); stop = threading.Event(); ids = []
        def run():
            ids.append(threading.get_native_id()); started.set(); stop.wait()
        before = threading.Thread(target=run); before.start(); started.wait()
        bind_process([{cpu}])
        after_set = []
        after = threading.Thread(target=lambda: after_set.append(os.sched_getaffinity(0)))
        after.start(); after.join()
        print(sorted(os.sched_getaffinity(ids[0])), sorted(after_set[0]))
        stop.set(); before.join()
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.split("]")[0] + "]" == f"[{cpu}]"
    assert out.stdout.strip().endswith(f"[{cpu}]")


def test_renice_process_raises_threads_started_before_and_after_never_lowers():
    code = textwrap.dedent(
        """
        import os, threading
        from pagedattn.distributed.cpu_bind import renice_process
        started = threading.Event(); stop = threading.Event(); ids = []
        def run():
            ids.append(threading.get_native_id()); started.set(); stop.wait()
        before = threading.Thread(target=run); before.start(); started.wait()
        os.setpriority(os.PRIO_PROCESS, ids[0], 12)
        first = renice_process(5)
        after = []
        t = threading.Thread(target=lambda: after.append(os.getpriority(os.PRIO_PROCESS, 0)))
        t.start(); t.join()
        print(first, os.getpriority(os.PRIO_PROCESS, ids[0]), after[0])
        stop.set(); before.join()
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    # The caller and a thread started after it: 5; a thread already nicer (12) keeps its 12.
    assert out.stdout.split() == ["5", "12", "5"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_bind_to_slots_binds_the_union_or_nothing():
    """The PD ingress runs on the prefill slots' CPUs; when a slot has none it stays unbound."""
    cpus = sorted(os.sched_getaffinity(0))
    code = textwrap.dedent(
        f"""
        import os
        from pagedattn.distributed.cpu_bind import AUTO, OFF, bind_to_slots
        before = sorted(os.sched_getaffinity(0))
        assert bind_to_slots(OFF, [0], 1) is None
        assert bind_to_slots(AUTO, [0, {len(cpus)}], 1) is None  # the second slot does not fit
        assert bind_to_slots(AUTO, [], 1) is None
        assert sorted(os.sched_getaffinity(0)) == before
        bound = bind_to_slots([[{cpus[1]}], [{cpus[0]}], [{cpus[1]}]], [0, 2], 1)
        print(bound, sorted(os.sched_getaffinity(0)))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == f"[{cpus[1]}] [{cpus[1]}]"  # slots 0 and 2, not slot 1
