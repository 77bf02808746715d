"""The default model (SmolLM2 Q4_1, its blocks as stored, float32 activations): prompt lookup
gives plain decoding's tokens (the verify steps run the same int8 dot kernels row by row)."""

from __future__ import annotations

from pagedattn import LLM, SamplingParams
from pagedattn.model.layers import Linear

DOC = (
    "The pool hands out blocks of sixteen tokens. A request holds a block table; the scheduler "
    "reserves slots before each step and frees them when the request ends."
)


def test_smollm2_greedy_is_token_identical_with_ngram():
    messages = [[{"role": "user", "content": f"Repeat this text exactly:\n\n{DOC}"}]]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = LLM(dtype="float32", num_blocks=64)
    want = plain.chat(messages, params)[0].outputs[0]
    del plain
    spec = LLM(dtype="float32", num_blocks=64, speculative_method="ngram", num_speculative_tokens=5)
    got = spec.chat(messages, params)[0].outputs[0]
    layers = [m for m in spec.engine.runner.model.modules() if isinstance(m, Linear)]
    assert layers and all(m.decode.name == "gguf" for m in layers)  # the blocks as stored
    assert got.token_ids == want.token_ids and got.text == want.text
    stats = spec.get_stats().spec_decode
    assert stats.num_accepted_tokens > 10  # the answer copies the prompt
