"""`pagedattn bench throughput --lora N`: uniform over N rank-16 adapters against no LoRA.

The adapters are made on the fly and every step mixes them; then one more adapter is loaded
while the batch runs, and the steps after it are set against the median step.

Both runs are in this process, one after the other, on the same model and options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedattn.benchmarks.workloads import SIZE_PRESETS, Workload, make_workloads, model_vocab
from pagedattn.cpu.features import describe_cpu

LORA_RANK = 16
_TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def make_random_adapter(llm, folder: Path, seed: int, rank: int = LORA_RANK) -> Path:
    """A PEFT folder of random A and B (std 0.02) on every q/k/v/o/gate/up/down of the model."""
    from safetensors.torch import save_file

    from pagedattn.lora.manager import FUSED_MODULES

    manager = llm.engine.runner.lora_manager
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer_index, fused), layer in manager.layers.items():
        part = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
        for hf, out in zip(FUSED_MODULES[fused], layer.slices, strict=True):
            prefix = f"base_model.model.model.layers.{layer_index}.{part}.{hf}"
            a = torch.randn(rank, layer.in_features, generator=gen) * 0.02
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = [m for names in _TARGETS.values() for m in names]
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def _run(llm, workload: Workload, loras: list, load_at: int | None = None, extra=None) -> dict:
    """Every request at once, stepped to the end; with ``load_at``, ``extra`` (a LoRARequest)
    is read and registered after that many steps, once every prompt is computed (so the steps
    after it are decode steps, also where prefill takes more steps, as in float32), and 4
    requests under it join."""
    from pagedattn import SamplingParams

    engine = llm.engine
    for i, req in enumerate(workload.requests):
        engine.add_request(
            f"r{i}",
            req.prompt_token_ids,
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=req.max_tokens),
            lora_request=loras[i % len(loras)] if loras else None,
        )
    steps: list[float] = []
    load = {}
    num_tokens = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        scheduler = engine.scheduler
        decoding = not scheduler.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running
        )
        if load_at is not None and not load and len(steps) >= load_at and decoding:
            ts = time.perf_counter()
            adapter = engine.loras.read(extra)  # a server reads the files off the engine thread
            tr = time.perf_counter()
            engine.loras.add(adapter)
            load = {"read_s": tr - ts, "register_s": time.perf_counter() - tr, "step": len(steps)}
            manager = engine.runner.lora_manager
            copy_before = manager.slot_load_s
            for j in range(4):
                # NOTE: short prompts: the step that loads the adapter is not also a prefill.
                engine.add_request(
                    f"x{j}",
                    workload.requests[j].prompt_token_ids[:4],
                    SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8),
                    lora_request=extra,
                )
        ts = time.perf_counter()
        for out in engine.step():
            if out.finished:
                num_tokens += len(out.outputs[0].token_ids)
        steps.append(time.perf_counter() - ts)
        if load and "slot_copy_s" not in load:
            load["slot_copy_s"] = engine.runner.lora_manager.slot_load_s - copy_before
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "tokens": num_tokens, "steps": steps, "load": load}


def run_lora_bench(args: argparse.Namespace) -> int:
    from pagedattn import LLM, LoRARequest

    n = args.lora
    size = "quick" if args.quick else args.size
    vocab_size, special, _ = model_vocab(args.model)
    workload = make_workloads(SIZE_PRESETS[size], vocab_size, special, args.seed)["uniform"]
    machine = describe_cpu(args.threads)
    load_start = os.getloadavg()
    print(f"machine: {machine}; load average {load_start[0]:.2f} at start")
    print(
        f"[uniform] {len(workload.requests)} requests x "
        f"{len(workload.requests[0].prompt_token_ids)} prompt + "
        f"{workload.requests[0].max_tokens} output tokens; LoRA: {n} adapters rank "
        f"{LORA_RANK}, request i under adapter i % {n}"
    )
    options = dict(
        dtype=args.dtype, num_threads=args.threads, seed=args.seed, block_size=args.block_size
    )
    if args.num_blocks:
        options["num_blocks"] = args.num_blocks
    warm = [workload.requests[0].prompt_token_ids[:16]] * 2
    from pagedattn import SamplingParams

    warm_params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)

    base = LLM(args.model, **options)
    base.generate(warm, warm_params)
    plain = _run(base, workload, [])
    del base
    # NOTE: the compiled decode stack's share of the no-LoRA run (adapter rows run on it too).
    base = LLM(args.model, decode_stack=False, **options)
    base.generate(warm, warm_params)
    no_stack = _run(base, workload, [])
    del base

    llm = LLM(args.model, enable_lora=True, max_loras=n + 1, max_lora_rank=LORA_RANK, **options)
    with tempfile.TemporaryDirectory(prefix="pagedattn-lora-") as tmp:
        loras = [
            LoRARequest(f"bench-{i}", i + 1, str(make_random_adapter(llm, Path(tmp) / f"a{i}", i)))
            for i in range(n)
        ]
        extra_dir = make_random_adapter(llm, Path(tmp) / "extra", 1000)
        extra = LoRARequest("bench-extra", n + 1, str(extra_dir))
        llm.generate(warm, warm_params, lora_request=loras[0])
        mixed = _run(llm, workload, loras)
        for r in loras:
            llm.remove_lora(r.lora_name)
        loaded = _run(llm, workload, loras, load_at=len(workload.requests) // 2 + 4, extra=extra)
    load_end = os.getloadavg()

    tput_plain = plain["tokens"] / plain["elapsed_s"]
    tput_lora = mixed["tokens"] / mixed["elapsed_s"]
    ratio = tput_lora / tput_plain
    steps = loaded["steps"]
    at = loaded["load"]["step"]
    median = statistics.median(steps)
    after = steps[at : at + 3]
    worst = max(after) / median
    cmd = f"pagedattn bench throughput --lora {n} --size {size} --dtype {args.dtype}"
    print()
    print(f"command: {cmd}")
    print(f"machine: {machine}; load average {load_start[0]:.2f} -> {load_end[0]:.2f}")
    print("| run | output tokens | seconds | tokens/s | vs no LoRA |")
    print("|---|---|---|---|---|")
    print(f"| no LoRA | {plain['tokens']} | {plain['elapsed_s']:.2f} | {tput_plain:.1f} | 1.00x |")
    tput_ns = no_stack["tokens"] / no_stack["elapsed_s"]
    print(
        f"| no LoRA, --no-decode-stack | {no_stack['tokens']} | {no_stack['elapsed_s']:.2f} | "
        f"{tput_ns:.1f} | {tput_ns / tput_plain:.2f}x |"
    )
    print(
        f"| {n} adapters rank {LORA_RANK}, mixed in every step | {mixed['tokens']} | "
        f"{mixed['elapsed_s']:.2f} | {tput_lora:.1f} | {ratio:.2f}x |"
    )
    print(
        f"load while serving: files read {loaded['load']['read_s'] * 1e3:.1f} ms (off the engine "
        f"thread in the server), registered {loaded['load']['register_s'] * 1e3:.2f} ms, copied "
        f"into its slot {loaded['load']['slot_copy_s'] * 1e3:.1f} ms; the 3 "
        f"steps after it {', '.join(f'{s * 1e3:.1f}' for s in after)} ms vs median step "
        f"{median * 1e3:.1f} ms: worst {worst:.2f}x the median"
    )
    return 0
