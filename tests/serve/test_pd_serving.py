"""The OpenAI layer over a DisaggregatedEngine, as a PD decode replica wires it (no Ray): a
completion goes through the prefill, the transfer and the decode, and reads as one engine's."""

from __future__ import annotations

import asyncio

from pagedattn.engine.async_engine import AsyncLLMEngine
from pagedattn.entrypoints.openai.protocol import CompletionRequest
from pagedattn.entrypoints.openai.serving import OpenAIServing
from pagedattn.kv_transfer.pd import DecodeRole, PrefillRole
from pagedattn.serve.pd_engine import DisaggregatedEngine
from tests.model.tiny import make_tiny_llama
from tests.serve.test_pd_engine import PROMPT, PrefillHandle, _engine

MODEL = "tiny"


def test_a_completion_through_the_openai_layer_is_disaggregated(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "llama")
    single = _engine(model_dir)
    prefill_llm, decode_llm = _engine(model_dir), _engine(model_dir)
    prefill_role, decode_role = PrefillRole(prefill_llm), DecodeRole(decode_llm, timeout_s=2.0)
    prefill, decode = AsyncLLMEngine(prefill_llm), AsyncLLMEngine(decode_llm)
    try:
        pd = DisaggregatedEngine(
            decode, decode_role, PrefillHandle(prefill, prefill_role), 4, "pagedattn"
        )
        # NOTE: as pd_app.DecodeReplica does: the OpenAI layer's one engine seam.
        serving = OpenAIServing(decode, MODEL)
        serving.engine = pd
        body = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
        out = asyncio.run(serving.create_completion(CompletionRequest(**body), None))
        reference = OpenAIServing(AsyncLLMEngine(single), MODEL)
        expected = asyncio.run(reference.create_completion(CompletionRequest(**body), None))
        assert pd.num_disaggregated == 1 and pd.num_local == 0
        assert out["choices"][0]["text"] == expected["choices"][0]["text"]
        assert out["usage"] == expected["usage"]
    finally:
        for engine in (prefill, decode):
            engine.shutdown()
        prefill_role.close()
        decode_role.close()
