"""DisaggregatedEngine: a decode replica's engine as the OpenAI layer sees it.

``add_request`` sends the prompt to a prefill replica (through a handle whose router ranks the
prefill replicas by cached prefix) and waits for its first token and ``KVTransferParams``; the
stream it returns yields that token at once (TTFT is the prefill's), then pulls the blocks this
replica's prefix cache lacks from the prefill replica's BlockServer and continues the request on
the local engine as ``prompt + [first token]``. Outputs are rewritten to read as one request
(``JoinedOutput``): the original prompt, text and stop strings over the joined tokens, and the
client's timings (arrival here, first token when the prefill answered) in the request's metrics
and the server's TTFT/ITL/e2e histograms.

Failure: a prefill call that fails (the replica died) is retried once, then the request runs
wholly on this replica; a pull that fails loads nothing and the local engine recomputes (at once
when the prefill replica's BlockServer refuses or drops the connection: it died). Requests
whose decode half could not sample as one engine would (n > 1, logprobs, penalties, grammar) run
wholly here, as do prompts shorter than ``min_prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from pagedattn.core.kv_cache_utils import hash_request_tokens
from pagedattn.engine.errors import InvalidRequestError
from pagedattn.engine.outputs import RequestOutput
from pagedattn.kv_transfer.pd import (
    DecodeRole,
    KVTransferParams,
    PrefillRole,
    can_disaggregate,
    decode_params,
    decode_prompt,
    needs_decode,
    prefill_params,
)
from pagedattn.sampling_params import SamplingParams
from pagedattn.serve.pd_output import JoinedOutput

logger = logging.getLogger(__name__)

# Prefill calls per request before the request runs wholly on the decode replica.
MAX_PREFILL_ATTEMPTS = 2


def _user_error(exc: BaseException) -> bool:
    """An error about the request itself (so no retry): the engine's own or the API's."""
    from pagedattn.entrypoints.openai.protocol import APIError

    cause = getattr(exc, "cause", None)
    return any(isinstance(e, InvalidRequestError | APIError | ValueError) for e in (exc, cause))


async def run_prefill(
    engine, role: PrefillRole, request_id, prompt, params, cache_salt=None, priority=0
) -> tuple[RequestOutput, KVTransferParams | None]:
    """A prefill replica's half of a request on its AsyncLLMEngine: the first output, and the
    transfer params of its blocks (None when the first token ended the request)."""
    last = None
    async for out in engine.generate(
        prompt, prefill_params(params), request_id, priority=priority, cache_salt=cache_salt
    ):
        last = out
    comp = last.outputs[0]
    if not needs_decode(params, comp.finish_reason):
        return last, None
    # NOTE: waits for the writer to put the blocks in the outbox: off the event loop.
    tp = await asyncio.to_thread(
        role.transfer_params, last.prompt_token_ids, comp.token_ids[0], cache_salt
    )
    return last, tp


class DisaggregatedEngine:
    """Wraps the decode replica's AsyncLLMEngine; everything but add_request passes through."""

    def __init__(
        self,
        engine,
        role: DecodeRole,
        prefill,
        block_size: int,
        hash_seed: str,
        min_prompt_tokens: int = 0,
        preload: bool = True,
    ) -> None:
        self.engine = engine
        # Shorter prompts are computed here: they never wait behind long prompts on the prefill
        # replicas and skip a transfer, but each adds its prefill to one decode step (a 64-token
        # prompt: ~380 ms in float32, ~150 ms in bf16 on one core; docs/scaling.md, "bench pd").
        self.min_prompt_tokens = min_prompt_tokens
        self.role = role
        self.prefill = prefill
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.num_disaggregated = 0
        self.num_local = 0
        self.num_prefill_retries = 0
        self.transfers: list[dict[str, float]] = []
        # Pulled blocks go into the cache in pieces between steps (False: in the first step).
        self.preload = preload

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        owner: str | None = None,
        lora_request: Any = None,
    ):
        """Prefill elsewhere, then a stream that yields the first token and continues here.

        NOTE: a request under a LoRA adapter runs wholly here (the prefill replica's call and the
        transfer keys carry no adapter)."""
        arrival = time.monotonic()
        continued_from = None
        if (
            lora_request is None
            and can_disaggregate(params)
            and isinstance(prompt, list)
            and len(prompt) >= self.min_prompt_tokens
        ):
            self._check_fits(prompt, params)
            result = await self._prefill(request_id, prompt, params, priority, cache_salt)
            if result is not None:
                self.num_disaggregated += 1
                first, tp = result
                times = (arrival, time.monotonic())
                return PDStream(self, request_id, first, tp, params, priority, owner, times)
            continued_from = (arrival, None)  # NOTE: the failed prefills count in its TTFT
        self.num_local += 1
        return await self.engine.add_request(
            request_id,
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            owner=owner,
            lora_request=lora_request,
            continued_from=continued_from,
        )

    def observe_first_token(self, joined: JoinedOutput, finished: bool) -> None:
        """The client's TTFT (arrival here to the prefill's answer) in the server's metrics;
        the decode half's tokens and finish are the engine's to record."""
        metrics = self.engine.metrics
        ttft = joined.first_token_time - joined.arrival_time
        metrics.observe_first_token(ttft, len(joined.first.prompt_token_ids))
        metrics.observe_tokens(len(joined.token_ids), None)
        if finished:
            metrics.observe_finished(ttft, joined.first.outputs[0].finish_reason or "stop")

    def _check_fits(self, prompt: list[int], params: SamplingParams) -> None:
        """Refuse here, before the prefill, a request the decode engine could never hold."""
        llm = self.engine.engine
        # NOTE: reads only the engine's fixed limits: safe beside its loop thread.
        room = llm.scheduler.max_tokens_that_fit(len(prompt))
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            param = "prompt" if room < 1 else "max_tokens"
            raise InvalidRequestError(
                f"a prompt of {len(prompt)} tokens leaves room for {room} output tokens in "
                f"max_model_len={llm.max_model_len} and the decode replica's KV cache of "
                f"{llm.kv_cache_manager.num_usable_blocks} blocks: lower max_tokens or shorten "
                "the prompt",
                param=param,
            )

    async def _prefill(self, request_id, prompt, params, priority, cache_salt):
        """(first output, transfer params or None), or None once MAX_PREFILL_ATTEMPTS failed."""
        hashes = hash_request_tokens(self.block_size, prompt, self.hash_seed, cache_salt=cache_salt)
        for attempt in range(MAX_PREFILL_ATTEMPTS):
            call = self.prefill.prefill.remote(
                request_id, prompt, params, cache_salt, priority, routing_hashes=hashes
            )
            try:
                return await call
            except asyncio.CancelledError:
                call.cancel()  # NOTE: the client left: the prefill replica aborts it
                raise
            except Exception as exc:
                if _user_error(exc):
                    raise
                self.num_prefill_retries += 1
                logger.warning(
                    "prefill of %s failed (attempt %d): %r", request_id, attempt + 1, exc
                )
        logger.warning("prefill of %s failed; computing it on this decode replica", request_id)
        return None


async def preload_pulled(engine, role: DecodeRole, tp: KVTransferParams, result) -> int:
    """Copy a pull's blocks into the decode cache piece by piece, one engine call (between two
    steps) per piece, before the request is added; returns the blocks that stay for a
    first-step load: the last piece (so a short prompt's transfer costs no extra engine round
    trip), and any that preload_piece left in the inbox."""
    start = result.num_local_blocks
    end = start + result.num_blocks
    while end - start > role.piece_blocks:
        num = await engine.call(lambda llm, s=start: role.preload_piece(llm, tp, s, end))
        if num == 0:
            break
        start += num
    return end - start


class PDStream:
    """One disaggregated request's outputs: the prefill's first token, then the local decode."""

    def __init__(self, owner_engine, request_id, first, tp, params, priority, owner, times):
        self._pd = owner_engine
        self._request_id = request_id
        self._tp: KVTransferParams | None = tp
        self._params = params
        self._priority = priority
        self._owner = owner
        self._times = times
        tokenizer = owner_engine.engine.engine.tokenizer
        self._joined = JoinedOutput(first, params, tokenizer, *times)
        self._inner = None
        # The pull and the add of the decode half: started with the first token (so they run
        # while it travels to the client), awaited by the second __anext__.
        self._starting: asyncio.Task | None = None
        self._handoff: dict[str, float] = {}
        self._handoff_start = 0.0
        self._sent_first = False
        self._finished = tp is None
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._request_id

    def __aiter__(self) -> PDStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed or (self._sent_first and self._finished):
            raise StopAsyncIteration
        if not self._sent_first:
            self._sent_first = True
            if self._tp is not None:
                self._starting = asyncio.ensure_future(self._start_decode())
            self._pd.observe_first_token(self._joined, self._tp is None)
            return self._joined.first_output(finished=self._tp is None)
        if self._inner is None:
            await self._starting
        decoded = await self._inner.__anext__()
        if "first_decode_s" not in self._handoff:
            self._handoff["first_decode_s"] = time.monotonic() - self._handoff_start
        out = self._joined.add(decoded)
        self._finished = out.finished
        if out.finished and not decoded.finished:
            await self._inner.aclose()  # NOTE: a stop string over the joined text: abort the rest
        return out

    async def _start_decode(self) -> None:
        tp, pd = self._tp, self._pd
        handoff = self._handoff
        self._handoff_start = start = time.monotonic()
        future = pd.role.submit_pull(tp)
        if future is None:
            pulling = asyncio.get_running_loop().run_in_executor(None, pd.role.pull, tp)
        else:
            pulling = asyncio.wrap_future(future)
        try:
            result = await asyncio.shield(pulling)
        except asyncio.CancelledError:
            # NOTE: the client left: the pull's thread runs on, and what it puts in the inbox
            # after aclose() released the request's keys is dropped when it ends.
            pulling.add_done_callback(lambda _: pd.role.release(tp))
            raise
        # NOTE: the handoff's timings (pull, queued in the engine, first decoded token) are
        # filled in as they happen; `bench pd` reports them.
        handoff.update(dataclasses.asdict(result), pulled_s=time.monotonic() - start)
        pd.transfers.append(handoff)
        del pd.transfers[:-256]
        if pd.preload:
            await preload_pulled(pd.engine, pd.role, tp, result)
        self._inner = await pd.engine.add_request(
            self._request_id,
            decode_prompt(tp),
            decode_params(self._params),
            priority=self._priority,
            cache_salt=tp.cache_salt,
            owner=self._owner,
            continued_from=self._times,
        )
        handoff["added_s"] = time.monotonic() - start

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._starting is not None and not self._starting.done():
            # NOTE: a decode half being added when the client left is aborted by the cancel.
            self._starting.cancel()
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._inner is not None:
            await self._inner.aclose()
        if self._tp is not None:
            self._pd.role.release(self._tp)
