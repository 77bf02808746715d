"""LoRA parity on the real default model (SmolLM2-135M GGUF): two adapters and the base in one
batch, greedy float32, against HF transformers + PEFT."""

from __future__ import annotations

import pytest
import torch

from pagedattn import LLM, LoRARequest, SamplingParams
from tests.lora.adapters import ALL_TARGETS

NUM_NEW = 8


@pytest.mark.slow
def test_smollm2_two_adapters_and_base_match_hf_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagedattn.model.loader import packaged_model_path

    path = packaged_model_path("smollm2-135m")

    def hf_base():
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()

    adapters = {}
    for name, rank, seed in (("a8", 8, 1), ("a16", 16, 2)):
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_TARGETS)
        model = get_peft_model(hf_base(), config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        model.save_pretrained(tmp_path / name)
        adapters[name] = tmp_path / name
    llm = LLM(
        dtype="float32",
        num_blocks=64,
        block_size=16,
        enable_lora=True,
        max_loras=2,
        weights="dequantize",  # HF PEFT computes on the dequantised file
    )
    prompts = [llm.engine.tokenize(t) for t in ("The capital of France is", "One, two, three,")]
    names = [None, "a8", "a16", "a8", None, "a16"]
    reqs = [
        None if n is None else LoRARequest(n, 1 + (n == "a16"), str(adapters[n])) for n in names
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate([prompts[i % 2] for i in range(6)], params, lora_request=reqs)
    expected = {}
    for name in (None, "a8", "a16"):
        model = hf_base()
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).eval()
        with torch.inference_mode():
            for i, prompt in enumerate(prompts):
                # NOTE: a plain argmax loop: generate()'s min_new_tokens would forbid EOS.
                tokens = list(prompt)
                for _ in range(NUM_NEW):
                    tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
                expected[(name, i)] = tokens[len(prompt) :]
    assert [o.outputs[0].token_ids for o in outs] == [
        expected[(n, i % 2)] for i, n in enumerate(names)
    ]
    assert len({tuple(expected[(n, 0)]) for n in (None, "a8", "a16")}) == 3
