"""LoRA over a quantised base: the default model's Q4_1 blocks as stored, adapters in float32 beside
them (issue 48: LoRA works on GGUF weights)."""

from __future__ import annotations

import torch

from pagedattn import LLM, LoRARequest, SamplingParams
from pagedattn.model.layers import Linear

NUM_NEW = 10


def _smollm2_shaped_adapter(out_dir):
    """A random PEFT adapter of SmolLM2-135M's shapes (no weights of the base are needed)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    )  # fmt: skip
    lora = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
    )  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), lora)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out_dir)
    return out_dir


def test_an_adapter_over_blocks_as_stored_answers_as_over_the_dequantised_base(tmp_path):
    adapter = LoRARequest("x", 1, str(_smollm2_shaped_adapter(tmp_path / "x")))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "The capital of France is"]
    outs = {}
    for weights in ("auto", "dequantize"):
        llm = LLM(dtype="float32", num_blocks=64, block_size=16, enable_lora=True, max_loras=1,
                  weights=weights)  # fmt: skip
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
        assert all((m.decode.name == "gguf") == (weights == "auto") for m in layers)
        outs[weights] = [
            o.outputs[0] for o in llm.generate(prompts, params, lora_request=[adapter, None])
        ]
    # The adapter changes the answer, and over the blocks (int8 activations) it answers as over
    # the dequantised weights: the same tokens, or (vLLM's rule for two numerics) where they
    # first part, past the first 3, each side's token is among the other's top 2. NOTE: not
    # token-identical: the int8 rounding of the activations moves with the float rounding
    # before it, and at the sixth token the two leaders are 0.025 nats apart on AMD Zen 4 (the
    # AVX-512 build's int8 path picks one of them, the AVX2 build's the other).
    auto, ref = outs["auto"][0], outs["dequantize"][0]
    assert auto.token_ids != outs["auto"][1].token_ids
    for i, (x, y) in enumerate(zip(auto.token_ids, ref.token_ids, strict=True)):
        if x != y:
            assert i >= 3 and x in ref.logprobs[i] and y in auto.logprobs[i], (i, x, y)
            break
