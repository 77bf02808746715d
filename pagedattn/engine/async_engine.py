"""AsyncLLMEngine: one background thread steps the engine; asyncio callers stream its outputs.

The thread owns the `LLMEngine` (nothing else touches it). Callers send commands through a
thread-safe queue (add, abort, call); the thread applies all pending commands before each
`step()`, so new requests join the running batch at the next step (continuous batching) and an
aborted request's blocks are freed before the next step runs. Outputs go back to per-request
`asyncio.Queue`s through `loop.call_soon_threadsafe`.

Failure isolation: a request that fails inside a step comes back from `step()` finished with an
`error`; only that request's stream raises `RequestFailedError`, and the loop goes on. Any
exception out of `step()` is an engine fault: every request in flight fails with
`EngineDeadError`, `is_running` turns False (so `/health` answers 503) and the fault listeners
run (the server exits non-zero so that a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from pagedattn.engine.outputs import RequestOutput
from pagedattn.metrics import ServerMetrics
from pagedattn.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

ABORT_FINISH_REASON = "abort"
# Seconds between health checks of an idle engine (a dead tensor-parallel rank).
IDLE_HEALTH_CHECK_S = 1.0
# What a client is told when a fault stopped the engine (the exception goes to the log only).
FAULT_MESSAGE = "the engine stopped after a fault (the server log has the detail)"
# Step durations kept (AsyncLLMEngine.step_seconds).
STEP_HISTORY = 1 << 14


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or a step raised); no request can be served.

    ``client_message``: what a client is told (no internal exception text; the log has it).
    """

    def __init__(self, message: str, client_message: str | None = None) -> None:
        super().__init__(message)
        self.client_message = client_message or message


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its blocks are freed); other requests go on."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed in the engine: {message}")
        self.request_id = request_id
        self.message = message


@dataclass
class _RequestState:
    """A request in flight: where its outputs go, and its timings for the latency metrics."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival_time: float
    # Who sent it (the server's tenant id); scopes what `kv_snapshot(owner=...)` shows.
    owner: str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens_seen: dict[int, int] = field(default_factory=dict)

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand an item to the request's event loop; False if that loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed
            return False
        return True


@dataclass
class _Add:
    state: _RequestState
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    accepted: Future
    lora_request: Any = None  # pagedattn.lora.LoRARequest


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    result: Future


_STOP = object()


class RequestStream:
    """The outputs of one request, as an async iterator.

    Closing it before the request finished aborts the request, also when it was never iterated
    (an async generator that never started would skip its `finally`).
    """

    def __init__(self, engine: AsyncLLMEngine, state: _RequestState) -> None:
        self._engine = engine
        self._state = state
        self._finished = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or self._closed:
            raise StopAsyncIteration
        try:
            item = await self._state.queue.get()
        except BaseException:
            # NOTE: cancelled while waiting (client gone): the request must not run on.
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        self._finished = item.finished
        return item

    async def aclose(self) -> None:
        """Stop reading; aborts the request in the engine unless it already finished."""
        if not self._finished and not self._closed:
            self._engine.abort(self._state.request_id)
        self._closed = True


class AsyncLLMEngine:
    """Serves many asyncio callers from one engine loop thread per engine."""

    def __init__(self, engine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics if metrics is not None else ServerMetrics(engine.model_name)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._states: dict[str, _RequestState] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        # The exception that stopped the loop when it was an engine fault (not a shutdown).
        self.fault: BaseException | None = None
        self._fault_listeners: list[Callable[[BaseException], None]] = []
        # The heartbeat: when the loop thread started its current step (None while it waits).
        self._busy_since: float | None = None
        # Seconds of the last steps (commands applied plus step()), for benchmarks' stall checks.
        self.step_seconds: deque[float] = deque(maxlen=STEP_HISTORY)
        # The last inter-token latencies as this loop delivered them (before any network hop),
        # but a PD decode half's first (see _observe).
        self.itl_seconds: deque[float] = deque(maxlen=STEP_HISTORY)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def add_fault_listener(self, fn: Callable[[BaseException], None]) -> None:
        """Call `fn(exc)` (from the loop thread) if the engine faults."""
        self._fault_listeners.append(fn)

    def busy_s(self) -> float:
        """Seconds the loop thread has spent in its current step and commands (0.0 when idle).

        A step stuck for long (a hung read, a runaway kernel) shows here while `is_running` is
        still True; `/health` reports it.
        """
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def is_running(self) -> bool:
        """True while the loop thread can take requests."""
        return self._dead is None

    def start(self) -> None:
        """Start the loop thread (idempotent; `add_request` starts it too)."""
        self._submit(None)

    def _submit(self, cmd: _Add | _Call | None) -> None:
        # NOTE: under the lock that `_stop` takes, so no command can slip in after the final
        # drain of a stopped loop (its future would never be resolved).
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(
                    f"the engine loop has stopped: {self._dead}",
                    getattr(self._dead, "client_message", FAULT_MESSAGE),
                )
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pagedattn-engine-loop", daemon=True
                )
                self._thread.start()
            if cmd is not None:
                self._commands.put(cmd)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort whatever is still in flight and stop the loop thread."""
        if self.request_stop():
            self._thread.join(timeout)

    def request_stop(self) -> bool:
        """Fail every request in flight with EngineDeadError and stop the loop; returns at once.

        False when no loop thread is running.
        """
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._dead = self._dead or EngineDeadError("the engine was shut down")
                return False
            self._commands.put(_STOP)
        return True

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        owner: str | None = None,
        lora_request: Any = None,
        continued_from: tuple[float, float | None] | None = None,
    ) -> RequestStream:
        """Queue a request; raises the engine's error if it rejects it, else returns its stream.

        continued_from: (arrival, first token or None) time.monotonic() of a request that began
        elsewhere (a PD decode half, or one whose prefill failed): the latency metrics are then
        the client's.
        """
        loop = asyncio.get_running_loop()
        state = _RequestState(request_id, loop, asyncio.Queue(), time.monotonic(), owner)
        if continued_from is not None:
            state.arrival_time, state.first_token_time = continued_from
            state.last_token_time = state.first_token_time
        accepted: Future = Future()
        self._submit(_Add(state, prompt, params, priority, cache_salt, accepted, lora_request))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, state)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes; leaving early aborts it."""
        stream = await self.add_request(
            request_id, prompt, params, priority=priority, cache_salt=cache_salt
        )
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once); its blocks are freed before next step."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        result: Future = Future()
        self._submit(_Call(fn, result))
        return await asyncio.wrap_future(result)

    async def kv_snapshot(self) -> dict:
        """The engine's block states and block tables, taken between steps."""
        return await self.call(lambda engine: engine.kv_snapshot())

    async def kv_snapshot_with_owned(self, owner: str | None) -> tuple[dict, set[str]]:
        """`kv_snapshot()` and, taken at the same moment, the ids of the requests in flight that
        `owner` sent."""

        def take(engine) -> tuple[dict, set[str]]:
            ids = {rid for rid, s in self._states.items() if s.owner == owner}
            return engine.kv_snapshot(), ids

        return await self.call(take)

    async def get_stats(self):
        """The engine's `EngineStats`, taken between steps."""
        return await self.call(lambda engine: engine.get_stats())

    # ---- the loop thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands = [self._next_command()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(cmd is _STOP for cmd in commands):
                    self._stop(EngineDeadError("the server is shutting down"), commands)
                    return
                self._busy_since = time.monotonic()
                for cmd in commands:
                    self._apply(cmd)
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self.step_seconds.append(time.monotonic() - self._busy_since)
                self.metrics.record_engine_stats(self.engine.get_stats())
                self._busy_since = None
        except BaseException as exc:
            logger.exception("engine fault: failing every request in flight and stopping")
            self.fault = exc
            self._stop(
                EngineDeadError(f"the engine stopped after a fault: {exc!r}", FAULT_MESSAGE), []
            )
            for fn in self._fault_listeners:
                try:
                    fn(exc)
                except Exception:
                    logger.exception("a fault listener failed")

    def _next_command(self) -> Any:
        """Wait for a command while idle, checking the engine's health every second, so that a
        dead tensor-parallel rank turns /health to 503 without a request to fail first."""
        while True:
            try:
                return self._commands.get(timeout=IDLE_HEALTH_CHECK_S)
            except queue.Empty:
                self.engine.check_health()

    def _stop(self, error: EngineDeadError, pending: list) -> None:
        with self._lock:
            self._dead = error
        while True:
            try:
                pending.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for cmd in pending:
            if isinstance(cmd, _Add | _Call):
                future = cmd.accepted if isinstance(cmd, _Add) else cmd.result
                if future.set_running_or_notify_cancel():
                    future.set_exception(error)
        ids = list(self._states)
        for state in self._states.values():
            state.put(error)
        self._states.clear()
        try:
            self.engine.abort_request(ids)
        except Exception:  # the engine may be the thing that failed
            logger.exception("could not abort %d requests while stopping", len(ids))

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Add):
            # NOTE: False when the caller was cancelled while queued: then nobody would read the
            # outputs, so the request is not added at all. Once running, the future cannot be
            # cancelled, so setting its result below cannot race with the caller.
            if not cmd.accepted.set_running_or_notify_cancel():
                return
            try:
                self.engine.add_request(
                    cmd.state.request_id,
                    cmd.prompt,
                    cmd.params,
                    priority=cmd.priority,
                    cache_salt=cmd.cache_salt,
                    lora_request=cmd.lora_request,
                )
            except Exception as exc:
                cmd.accepted.set_exception(exc)
                return
            self._states[cmd.state.request_id] = cmd.state
            cmd.accepted.set_result(None)
        elif isinstance(cmd, _Abort):
            state = self._states.pop(cmd.request_id, None)
            if state is not None:
                self.engine.abort_request(cmd.request_id)
                self.metrics.observe_finished(
                    time.monotonic() - state.arrival_time, ABORT_FINISH_REASON
                )
        elif cmd.result.set_running_or_notify_cancel():
            try:
                cmd.result.set_result(cmd.fn(self.engine))
            except Exception as exc:
                cmd.result.set_exception(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # aborted after the step was scheduled
            self._observe(state, out, now)
            if out.finished:
                del self._states[out.request_id]
            error = getattr(out, "error", None)
            if error is not None:
                # NOTE: the engine already freed the request's blocks; only its caller hears.
                logger.warning("request %s failed: %s", out.request_id, error)
                self._states.pop(out.request_id, None)
                state.put(RequestFailedError(out.request_id, str(error)))
                continue
            if not state.put(out) and not out.finished:
                del self._states[out.request_id]
                self.engine.abort_request(out.request_id)

    def _observe(self, state: _RequestState, out: RequestOutput, now: float) -> None:
        # NOTE: the first local token of a continued request (a PD decode half) has an ITL from
        # the prefill's token: the handoff, which itl_seconds leaves out.
        seen_before = bool(state.num_tokens_seen)
        num_new = 0
        for comp in out.outputs:
            num_new += len(comp.token_ids) - state.num_tokens_seen.get(comp.index, 0)
            state.num_tokens_seen[comp.index] = len(comp.token_ids)
        if num_new > 0:
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.observe_first_token(
                    now - state.arrival_time, len(out.prompt_token_ids)
                )
                self.metrics.observe_tokens(num_new, None)
            else:
                self.metrics.observe_tokens(num_new, now - state.last_token_time)
                if seen_before:
                    self.itl_seconds.append(now - state.last_token_time)
            state.last_token_time = now
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            self.metrics.observe_finished(now - state.arrival_time, reason)
