"""Quality on a GGUF file: mean NLL per token of a fixed text, pagedattn and llama.cpp side by side.

    pagedattn bench nll [--model smollm2-135m|gemma3-270m|X.gguf] [--dtype float32] [--threads 2]

Both engines score the same token ids (the file's tokenizer, its BOS where it adds one) of a
text no model here was tuned on: bench_quant's passage and the grounded workload's documents.
pagedattn runs the file as it loads it by default (its start-up lines say how);
llama.cpp runs the file as stored, with its default buffer types (use_extra_bufts off only where
those crash; llama_cpp_peer.py). Prints one line per engine, then the difference: a quantised
file run well by both should differ by well under 0.01 nats.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import math

import torch

from pagedattn.benchmarks.bench_quant import TEXT, SequenceRunner
from pagedattn.benchmarks.grounded_texts import ARTICLE, CODE_FILE, DOCUMENT
from pagedattn.benchmarks.llama_cpp_peer import (
    EXTRA_BUFTS_CHOICES,
    gguf_file_type,
    run_isolated,
)
from pagedattn.cpu.features import describe_cpu

HELD_OUT_TEXT = "\n\n".join((TEXT, ARTICLE, DOCUMENT, CODE_FILE))
CHUNK = 128  # tokens per forward: logits of [CHUNK, vocab] at a time


def pagedattn_nll(model, tokens: list[int], chunk: int = CHUNK) -> float:
    """Mean NLL of tokens[1:] given their prefixes, fed ``chunk`` tokens per forward (1: every
    token through the decode kernels, as generation runs them)."""
    runner = SequenceRunner(model, len(tokens) + chunk)
    total = 0.0
    for lo in range(0, len(tokens) - 1, chunk):
        part = tokens[lo : min(lo + chunk, len(tokens) - 1)]
        logprobs = torch.log_softmax(runner.forward(part, lo).double(), dim=-1)  # [T, V]
        target = torch.tensor(tokens[lo + 1 : lo + 1 + len(part)])
        total += float(-logprobs.gather(1, target[:, None]).sum())
    return total / (len(tokens) - 1)


def resident_mib() -> float:
    """This process's resident memory now (VmRSS), in MiB."""
    for line in open("/proc/self/status").read().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def file_types(path) -> str:
    """The GGUF's tensor types with their counts: "Q4_K x 97, Q6_K x 17, F32 x 61"."""
    from gguf import GGMLQuantizationType

    from pagedattn.model.gguf_file import GGUFFile

    counts = collections.Counter(
        GGMLQuantizationType(t.tensor_type).name for t in GGUFFile(path).tensors
    )
    return ", ".join(f"{name} x {n}" for name, n in counts.most_common())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file or packaged name (default SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp-extra-bufts", choices=EXTRA_BUFTS_CHOICES, default="auto")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pagedattn.model.gguf_loader import GGUFCheckpoint
    from pagedattn.model.loader import load_model, resolve_checkpoint

    ckpt = resolve_checkpoint(args.model)
    if not isinstance(ckpt, GGUFCheckpoint):
        raise SystemExit(f"bench nll compares engines on one GGUF file; {args.model!r} is not one")
    loaded = load_model(ckpt, args.dtype, "cpu")
    tokens = loaded.tokenizer.encode(HELD_OUT_TEXT)
    print(f"machine: {describe_cpu(args.threads)}")
    print(
        f"model {ckpt.path.name} ({gguf_file_type(ckpt.path)}: {file_types(ckpt.path)}); "
        f"mean NLL of {len(tokens) - 1} tokens"
    )
    print(
        f"pagedattn: {args.dtype}, the file as the engine loads it by default "
        f"({loaded.plan.describe()}; process resident {resident_mib():.0f} MiB)"
    )
    rows = {
        f"pagedattn, {CHUNK} tokens per forward (prefill kernels)": pagedattn_nll(
            loaded.model, tokens
        ),
        "pagedattn, 1 token per forward (decode kernels)": pagedattn_nll(loaded.model, tokens, 1),
    }
    del loaded
    theirs = None
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: skipped, llama-cpp-python is not installed (make bench-peers)")
    else:
        job = {"gguf": str(ckpt.path), "tokens": tokens, "threads": args.threads}
        result = run_isolated("nll", job, args.llama_cpp_extra_bufts)
        theirs = rows[f"llama.cpp, {CHUNK} tokens per decode call"] = result["nll"]
        print(f"llama.cpp: the file as stored, buffer types {result['buffer_types']}")
    print("\n| engine | mean NLL | perplexity | minus llama.cpp's |\n|---|---|---|---|")
    for name, nll in rows.items():
        delta = "-" if theirs is None else f"{nll - theirs:+.4f}"
        print(f"| {name} | {nll:.4f} | {math.exp(nll):.2f} | {delta} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
