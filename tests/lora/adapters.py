"""PEFT adapters for tests: random A and B (B not zero), fixed seeds, saved as PEFT folders."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    rank: int,
    seed: int,
    targets: list[str] = ALL_TARGETS,
    alpha: int | None = None,
    std: float = 0.1,
) -> Path:
    """Save a LoRA of ``rank`` over the HF checkpoint at base_dir, with every A and B random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank if alpha is None else alpha,
        target_modules=targets,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out_dir)
    return out_dir


def hf_peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt: list[int], n: int):
    """Greedy tokens of HF transformers (+ PEFT's adapter), one full forward per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager"
    )
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]
