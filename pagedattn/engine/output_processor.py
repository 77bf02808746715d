"""Requests out: the scheduler's per-sequence outputs become RequestOutputs (text, stop strings)."""

from __future__ import annotations

import logging
import time

from pagedattn.core.request import Request, RequestStatus
from pagedattn.core.scheduler_output import CoreOutput
from pagedattn.engine.outputs import RequestOutput
from pagedattn.engine.request_state import EngineRequest, SeqState

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Tracks every live user request and the core sequences (n of them) that serve it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, EngineRequest] = {}
        self.seq_of: dict[str, SeqState] = {}  # core request id -> its sequence

    def add(self, ereq: EngineRequest, core: Request) -> None:
        """Track a new request and its first sequence."""
        self.requests[ereq.request_id] = ereq
        self.add_seq(ereq, core)

    def add_seq(self, ereq: EngineRequest, core: Request, num_pending: int = 0) -> SeqState:
        """Track one more sequence of a request (a fork).

        num_pending: its last tokens whose output is about to be processed (not yet text).
        """
        state = SeqState(ereq, len(ereq.seqs), core, self.tokenizer, num_pending)
        ereq.seqs.append(state)
        self.seq_of[core.request_id] = state
        return state

    def core_ids(self, request_id: str) -> list[str]:
        """The core sequence ids of a live request (empty if unknown)."""
        ereq = self.requests.get(request_id)
        return [] if ereq is None else [s.core.request_id for s in ereq.seqs]

    def remove(self, request_id: str) -> EngineRequest | None:
        """Forget a request and its sequences."""
        ereq = self.requests.pop(request_id, None)
        if ereq is not None:
            for s in ereq.seqs:
                self.seq_of.pop(s.core.request_id, None)
        return ereq

    def display_id(self, core_id: str) -> str:
        """A sequence's user-facing name: its request id, or ``<id>#<index>`` for a sibling."""
        state = self.seq_of.get(core_id)
        if state is None:
            return core_id
        rid = state.owner.request_id
        return rid if state.index == 0 else f"{rid}#{state.index}"

    def rename_snapshot(self, snapshot: dict) -> dict:
        """A kv_snapshot() with sequences under their user-facing names."""
        name = self.display_id
        snapshot["owners"] = [[name(r) for r in owners] for owners in snapshot["owners"]]
        for key in ("block_tables", "requests"):
            snapshot[key] = {name(r): v for r, v in snapshot[key].items()}
        return snapshot

    def add_prompt_logprobs(self, by_core_id: dict[str, list]) -> None:
        """Prompt-token logprobs a step computed, by core sequence id."""
        for core_id, entries in by_core_id.items():
            state = self.seq_of.get(core_id)
            if state is not None:
                state.owner.add_prompt_logprobs(entries)

    def process(
        self, core_outputs: list[CoreOutput]
    ) -> tuple[list[RequestOutput], list[str], list[str]]:
        """Apply one step's outputs.

        Returns (outputs of the requests that moved, core ids a stop string ended, core ids of
        requests that failed and must be aborted).
        """
        now = time.monotonic()
        touched: dict[str, EngineRequest] = {}
        stopped: list[str] = []
        to_abort: list[str] = []
        for out in core_outputs:
            state = self.seq_of.get(out.req_id)
            if state is None and out.fork is not None:
                parent = self.seq_of.get(out.forked_from)
                if parent is not None:
                    state = self.add_seq(parent.owner, out.fork, len(out.new_token_ids))
            if state is None:
                continue  # aborted meanwhile
            ereq = state.owner
            try:
                if state.on_output(out, now):
                    stopped.append(out.req_id)
            except Exception as exc:  # NOTE: one request's detokeniser must not stop the step
                logger.exception("output processing failed for request %s", ereq.request_id)
                state.finish_reason = "error"
                ereq.error = f"output processing failed: {exc}"
            if ereq.error is not None:
                to_abort += [s.core.request_id for s in ereq.seqs if s.finish_reason is None]
            touched[ereq.request_id] = ereq
        outputs = []
        for ereq in touched.values():
            outputs.append(ereq.make_output())
            if ereq.finished:
                ereq.metrics.finished_time = now
                self.remove(ereq.request_id)
        return outputs, stopped, to_abort

    def fail(self, request_id: str, message: str) -> RequestOutput | None:
        """End a request with an error outside a step's outputs."""
        ereq = self.remove(request_id)
        if ereq is None:
            return None
        ereq.error = message
        return ereq.make_output()


__all__ = ["OutputProcessor", "RequestStatus"]
