"""GrammarCompileWorker: grammar compiles in a child process that is killed at its deadline.

An xgrammar compile cannot be interrupted from Python (it has no cancellation), so a server
compiles in a process of its own. A warm zygote process imports xgrammar once (3-10 s) and
holds the tokenizer's info; each compile runs in a child forked from it (milliseconds), whose
result the zygote relays. Past the deadline the zygote kills the child and the next compile
forks a fresh one at once.

Protocol (frames of an 8-byte big-endian length and the bytes; JSON unless noted):
  parent -> zygote: the tokenizer info (raw), then per compile {"method", "text"}, and
                    {"kill": true} to stop the running compile;
  zygote -> parent: {"ready": true}; per compile {"pid"}, then {"ok": true} and the grammar
                    (raw, xgrammar's serialize_json), or {"ok": false, "error"}, or
                    {"ok": false, "killed": true}.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# How long the zygote may take to import xgrammar and read the tokenizer info.
START_TIMEOUT_S = 120.0
# How long the zygote may take to fork a child, or to report a killed one.
CONTROL_TIMEOUT_S = 30.0
_LEN_BYTES = 8


class GrammarCompileTimeout(Exception):
    """The compile ran past its deadline and was killed."""


class GrammarCompileFailed(Exception):
    """The compiler rejected the constraint; the message is xgrammar's first line."""


class GrammarWorkerError(RuntimeError):
    """The compile process failed (it died, or did not answer); it restarts on the next use."""


def _frame(data: bytes) -> bytes:
    return len(data).to_bytes(_LEN_BYTES, "big") + data


class _FrameReader:
    """Reads frames from a pipe, each before a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()
        self._selector = selectors.DefaultSelector()
        self._selector.register(fd, selectors.EVENT_READ)

    def _fill(self, num_bytes: int, deadline: float | None) -> None:
        while len(self._buffer) < num_bytes:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                raise TimeoutError
            if not self._selector.select(timeout):
                raise TimeoutError
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise EOFError
            self._buffer += chunk

    def read(self, deadline: float | None = None) -> bytes:
        self._fill(_LEN_BYTES, deadline)
        size = int.from_bytes(self._buffer[:_LEN_BYTES], "big")
        self._fill(_LEN_BYTES + size, deadline)
        data = bytes(self._buffer[_LEN_BYTES : _LEN_BYTES + size])
        del self._buffer[: _LEN_BYTES + size]
        return data

    def close(self) -> None:
        self._selector.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class GrammarCompileWorker:
    """The parent's handle on the zygote; one compile at a time (callers queue on a lock)."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._tokenizer_info = tokenizer_info_json.encode()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._to_zygote = -1
        self._reader: _FrameReader | None = None
        self.num_killed = 0

    @property
    def is_started(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the zygote if it is not running (blocks until it is ready)."""
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self.is_started:
            return
        self._stop()
        job_r, job_w = os.pipe()
        out_r, out_w = os.pipe()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        code = "from pagedattn.structured_output.compile_worker import zygote_main; zygote_main()"
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", code, str(job_r), str(out_w)],
                pass_fds=(job_r, out_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        finally:
            os.close(job_r)
            os.close(out_w)
        self._to_zygote, self._reader = job_w, _FrameReader(out_r)
        _write_all(self._to_zygote, _frame(self._tokenizer_info))
        try:
            ready = json.loads(self._reader.read(time.monotonic() + START_TIMEOUT_S))
        except (TimeoutError, EOFError) as exc:
            self._stop()
            raise GrammarWorkerError("the grammar compile process did not start") from exc
        if not ready.get("ready"):
            self._stop()
            raise GrammarWorkerError(f"the grammar compile process failed to start: {ready}")

    def compile(self, method: str, text: str, timeout_s: float) -> str:
        """xgrammar's serialized CompiledGrammar of ``compile_<method>(text)``.

        Raises GrammarCompileTimeout (the child was killed) or GrammarCompileFailed; the deadline
        counts from when the compile starts, not from starting the zygote."""
        with self._lock:
            self._ensure_started()
            assert self._reader is not None
            try:
                job = json.dumps({"method": method, "text": text}).encode()
                _write_all(self._to_zygote, _frame(job))
                json.loads(self._reader.read(time.monotonic() + CONTROL_TIMEOUT_S))  # {"pid"}
                deadline = time.monotonic() + timeout_s
                try:
                    reply = json.loads(self._reader.read(deadline))
                except TimeoutError:
                    _write_all(self._to_zygote, _frame(b'{"kill": true}'))
                    reply = json.loads(self._reader.read(time.monotonic() + CONTROL_TIMEOUT_S))
                    if reply.get("ok"):  # it finished as the kill arrived
                        self._reader.read(time.monotonic() + CONTROL_TIMEOUT_S)
                    self.num_killed += 1
                    raise GrammarCompileTimeout(f"the compile ran past {timeout_s:g} s") from None
                if reply.get("ok"):
                    return self._reader.read(time.monotonic() + CONTROL_TIMEOUT_S).decode()
            except (TimeoutError, EOFError, OSError, ValueError) as exc:
                self._stop()
                raise GrammarWorkerError("the grammar compile process stopped answering") from exc
            if reply.get("killed"):
                raise GrammarCompileFailed("the compiler process crashed on this constraint")
            raise GrammarCompileFailed(str(reply.get("error", "unknown error")))

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self._reader is not None:
            os.close(self._to_zygote)
            os.close(self._reader.fd)
            self._reader.close()
            self._reader = None
        if self._proc is not None:
            # NOTE: the zygote kills its running child when its job pipe closes.
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None


# ---- the zygote and its children (another process) ---------------------------------------------


def zygote_main() -> None:
    """Entry point of the compile process: `zygote_main()` with the two pipe fds in argv."""
    # NOTE: the parent's Ctrl-C reaches the whole process group; the parent ends the zygote.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    job_fd, out_fd = int(sys.argv[1]), int(sys.argv[2])
    reader = _FrameReader(job_fd)
    try:
        tokenizer_info_json = reader.read().decode()
    except EOFError:
        return
    try:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    except Exception as exc:
        _write_all(out_fd, _frame(json.dumps({"ready": False, "error": repr(exc)}).encode()))
        return
    _write_all(out_fd, _frame(b'{"ready": true}'))
    while True:
        try:
            job = json.loads(reader.read())
        except EOFError:
            return
        if "method" in job and not _run_child(xgr, info, job, reader, out_fd):
            return


def _run_child(xgr, info, job: dict, reader: _FrameReader, out_fd: int) -> bool:
    """Fork a child for one compile and relay its answer; False once the parent has gone."""
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compile, write the answer, exit without cleanup
        os.close(result_r)
        try:
            compiler = xgr.GrammarCompiler(info, max_threads=1)
            kwargs = {"any_whitespace": False} if job["method"] == "json_schema" else {}
            grammar = getattr(compiler, f"compile_{job['method']}")(job["text"], **kwargs)
            _write_all(
                result_w, _frame(b'{"ok": true}') + _frame(grammar.serialize_json().encode())
            )
        except Exception as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _write_all(result_w, _frame(json.dumps({"ok": False, "error": message}).encode()))
        os._exit(0)
    os.close(result_w)
    _write_all(out_fd, _frame(json.dumps({"pid": pid}).encode()))
    selector = selectors.DefaultSelector()
    selector.register(result_r, selectors.EVENT_READ, "result")
    selector.register(reader.fd, selectors.EVENT_READ, "parent")
    result = bytearray()
    parent_alive = True
    done = False
    while not done:
        for key, _ in selector.select():
            if key.data == "result":
                chunk = os.read(result_r, 1 << 20)
                result += chunk
                done = done or not chunk
            else:
                try:
                    message = reader.read(time.monotonic() + CONTROL_TIMEOUT_S)
                except (EOFError, TimeoutError):
                    parent_alive = False
                    message = b'{"kill": true}'
                if json.loads(message).get("kill"):
                    os.kill(pid, signal.SIGKILL)
                    selector.unregister(reader.fd)
    selector.close()
    os.close(result_r)
    _, status = os.waitpid(pid, 0)
    if not parent_alive:
        return False
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and result:
        _write_all(out_fd, bytes(result))
    else:
        _write_all(out_fd, _frame(b'{"ok": false, "killed": true}'))
    return True
