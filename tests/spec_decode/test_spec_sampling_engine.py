"""Sampling with speculation on a tiny model: the second token's distribution (drawn by rejection
sampling of an n-gram draft) matches the exact one computed by HF transformers."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from pagedattn import LLM, SamplingParams
from pagedattn.spec_decode.ngram_proposer import NgramProposer
from tests.model.tiny import make_tiny_llama

# Every ordinary token once, then a repeat: whatever the first sampled token, prompt lookup finds
# it in the prompt and drafts the token after it, so the second token goes through verification.
PROMPT = list(range(3, 128)) + [5, 6, 7]
TEMPERATURE = 0.5
NUM_SAMPLES = 3000


@torch.inference_mode()
def _exact(path) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t1 | prompt) [V] and p(t2 | prompt, t1) [V, V] at TEMPERATURE."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    p1 = (model(ids).logits[0, -1] / TEMPERATURE).softmax(-1)
    vocab = p1.shape[0]
    both = torch.cat([ids.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
    p2 = (model(both).logits[:, -1] / TEMPERATURE).softmax(-1)
    return p1, p2


def test_second_token_distribution_matches_exact(tmp_path):
    path = make_tiny_llama(tmp_path)
    p1, p2 = _exact(path)
    exact = p1 @ p2  # the marginal of the second token [V]
    # What always accepting the draft would give: the test's bound must sit below it.
    proposer = NgramProposer(1, 4)
    wrong = torch.zeros_like(exact)
    for t1 in range(p1.shape[0]):
        draft = proposer.propose(PROMPT + [t1], 1)
        if draft:
            wrong[draft[0]] += p1[t1]
        else:
            wrong += p1[t1] * p2[t1]
    tv_wrong = 0.5 * float((wrong - exact).abs().sum())
    llm = LLM(
        path,
        dtype="float32",
        num_blocks=1024,
        block_size=4,
        speculative_method="ngram",
        num_speculative_tokens=2,
        ngram_min=1,
        speculative_disable_by_batch_size=NUM_SAMPLES,
    )
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    counts = torch.zeros_like(exact)
    for out in outs:
        counts[out.outputs[0].token_ids[1]] += 1
    stats = llm.get_stats().spec_decode
    assert stats.num_drafts > 0.9 * NUM_SAMPLES  # second tokens came through verification
    tv = 0.5 * float((counts / NUM_SAMPLES - exact).abs().sum())
    # The expected TV of NUM_SAMPLES exact draws is 0.5 * sum sqrt(2 p (1 - p) / (pi N)); the
    # bound allows 2.5 times that, and must sit below what always accepting would give.
    noise = 0.5 * float((2 * exact * (1 - exact) / (torch.pi * NUM_SAMPLES)).sqrt().sum())
    bound = 2.5 * noise + 0.01
    assert tv < bound < tv_wrong, (tv, bound, tv_wrong)
