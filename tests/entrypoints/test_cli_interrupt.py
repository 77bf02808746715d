"""Issue 21: Ctrl-C while `pagedattn generate` starts up (torch importing, the model loading)
ends with `pagedattn: interrupted` and exit status 130, never a traceback.

The command runs in its own session and SIGINT goes to its whole process group, as a terminal's
Ctrl-C does (a compiler building the CPU extension would get it too). The moment is found, not
guessed: the signal is sent once the process has mapped libtorch (so `main()` is running and
torch is loading), then at later points of the start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.entrypoints.server_process import make_model_dir

START_TIMEOUT_S = 120.0
# Seconds after libtorch appears: while torch imports, then while the model and kernels load
# (start-up takes ~3.5 s on 2 busy cores; a fast machine may be done by the later delays).
DELAYS_AFTER_TORCH_S = (0.0, 1.0, 2.5)

pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("tiny"))


def _torch_mapped(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT unblocked and at its default action, as a shell started
    from a terminal leaves it (an ignored or blocked SIGINT is inherited through exec, and Python
    then installs no KeyboardInterrupt handler)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_generate(model: Path, delay_s: float) -> tuple[bool, int, str, str]:
    """Start `pagedattn generate`, Ctrl-C it `delay_s` after torch starts loading.

    Returns (signalled before the first output, exit status, stdout, stderr).
    """
    cmd = [sys.executable, "-m", "pagedattn.cli", "generate", "--model", str(model),
           "--dtype", "float32", "--threads", "1", "--max-tokens", "4"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        preexec_fn=_as_from_a_terminal,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _torch_mapped(proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "torch never loaded"
            time.sleep(0.01)
        try:
            proc.wait(delay_s)  # returns early only if it finished first
        except subprocess.TimeoutExpired:
            pass
        signalled = proc.poll() is None
        if signalled:
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=START_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # NOTE: the first prompt's header is printed once the model and the KV cache are ready.
    during_startup = signalled and "###" not in out.decode()
    return during_startup, proc.returncode, out.decode(), err.decode()


def test_ctrl_c_during_start_up_is_one_line_and_status_130(model):
    seen = []
    # NOTE: a delay retried: on a loaded machine the test process itself may be descheduled
    # until the command has started up, and then nothing lands during start-up.
    for delay_s in (*DELAYS_AFTER_TORCH_S, 0.0, 0.0):
        during_startup, code, out, err = _interrupt_generate(model, delay_s)
        seen.append(f"delay {delay_s} s: status {code}, during start-up {during_startup}")
        if code == 0 and not during_startup:
            continue  # it finished first (a fast machine): nothing to check at this delay
        if code == -signal.SIGINT and "[kv] time:" in out:
            # NOTE: it had printed its last line and was exiting when the signal came: Python's
            # own exit by SIGINT, which a shell reports as status 130 (seen on AMD Zen 4 at 2.5 s)
            continue
        context = f"delay {delay_s} s, status {code}\nstdout:\n{out}\nstderr:\n{err}"
        assert "Traceback" not in err, context
        assert code == 130, context
        assert err.rstrip().splitlines()[-1] == "pagedattn: interrupted", context
        if during_startup and len(seen) >= len(DELAYS_AFTER_TORCH_S):
            break
    # The first delay (0 s after libtorch is mapped) lands while torch still imports.
    assert any("during start-up True" in line for line in seen), "\n".join(seen)
