"""Print docs/structures.md: one line per module, from each module's docstring."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    lines = ["# Structures: one line per module", ""]
    for folder in ("pagedattn",):
        for path in sorted((ROOT / folder).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            first = doc.strip().splitlines()[0] if doc.strip() else "(package marker)"
            lines.append(f"- `{path.relative_to(ROOT)}`: {first}")
    lines += [
        "",
        "Native code, one extension built on first use per ISA level (`pagedattn/csrc`, written"
        " over at::vec::Vectorized: AVX2, AVX-512, NEON):",
        "",  # NOTE: MkDocs (Python-Markdown) reads a list only after a blank line.
        "- `paged_attention_cpu.cpp`: CPU paged decode attention through the block tables"
        " (vector code on every ISA, AVX512-BF16 scores; AMX tiles for bf16 and fp8 caches,"
        " AMX-INT8 for u8): the work plan, the threads' dispatch and the partitions' merge.",
        "- `attention_common_cpu.h`: paged attention's building blocks (online softmax,"
        " per-call parameters, scratch) and the chunk walk every kernel shares (walk_chunks).",
        "- `attention_vector_cpu.h`: the vector kernel of paged attention, every cache dtype on"
        " at::vec.",
        "- `attention_quant_cpu.h`: the one-byte caches' arithmetic (u8 integer path, fp8 pairs).",
        "- `attention_amx_cpu.h`: the AMX tile kernels of paged attention for bf16 and fp8 caches.",
        "- `attention_amx_u8_cpu.h`: the u8 cache's AMX-INT8 tile kernel.",
        "- `attention_prefill_cpu.h`: paged prefill attention (a span of a sequence's queries,"
        " causal, flash-style; rows as vector lanes, bf16 pairs on AVX512-BF16).",
        "- `bindings_cpu.cpp`: the extension's Python module: every kernel's bindings.",
        "- `quant_cpu.cpp`: linear layers and embeddings on GGUF weights kept in their stored"
        " blocks (int8 activations per block; parts of 8n rows repacked 8 rows interleaved, that"
        " kernel at every row count; parts of other row counts: dot kernels for decode rows,"
        " dequantised tiles for prefill).",
        "- `quant_x8_cpu.h`: Q4_K, Q5_K and Q6_K blocks of 8 rows interleaved, their repack,"
        " GEMM (VNNI int32 or AVX2 maddubs int16 sums per sub-block, scalar) and row"
        " dequantisation; the helpers every x8 kernel shares.",
        "- `quant_x8_low_cpu.h`: the same for Q2_K and Q3_K (2- and 3-bit values, 16-value"
        " groups; both group scales of a row in one vpdpwssd with VNNI), and their rows as stored"
        " (dequantise, dot in plain C++).",
        "- `quant_x8_iq_cpu.h`: the same for IQ4_XS (nibbles to values through a vpshufb table;"
        " value + 128 with VNNI, the sign trick on maddubs without).",
        "- `quant_x8_legacy_cpu.h`: the same for the legacy types (Q4_0, Q4_1, Q5_0, Q5_1,"
        " Q8_0, and IQ4_NL in Q4_0's layout through the IQ4 table; as many bytes as stored), and"
        " the dispatch over every type's x8 form.",
        "- `quant_x8_zmm_cpu.h`: every type's x8 GEMM on 512-bit vectors, two groups of 8 rows"
        " at once (AVX512-BW + VNNI builds, from 32 activation rows; bit-identical to one group at"
        " a time).",
        "- `quant_amx_cpu.h`: the same interleaved layers on AMX-INT8 tiles, two groups against"
        " 16 activation rows (one TDPBSSD per sub-block, scaled to the VNNI kernels' sums: bit"
        " for bit while partial sums stay below 2^24); `tests/cpu/amx_emulator.h` runs it on"
        " CPUs without AMX.",
        "- `quant_linear_cpu.h`: the QuantLinear class, declared for the decode stack to call"
        " the layers Python packed.",
        "- `quant_blocks_cpu.h`: the GGUF block formats as stored, and the int8 forms"
        " activations take to meet them (Q8_0, Q8_K).",
        "- `quant_dot_cpu.h`: dot products of GGUF weight blocks with int8 activation blocks"
        " (AVX2 maddubs, AVX-512 VNNI, scalar), and the rows as stored dequantised.",
        "- `linear_cpu.cpp`: the panel GEMM, one of the linear kernels the tuner measures"
        " (panels, dpbf16, AMX, MKL, oneDNN, F.linear).",
        "- `linear_dpbf16_cpu.cpp`: bf16 panels of 32 columns by k pairs through AVX512-BF16's"
        " dot product (`vdpbf16ps`), for CPUs with it and no AMX (AMD Zen 4 and 5); activations"
        " packed by k pair per 12-row block.",
        "- `linear_amx_cpu.cpp`: the AMX-BF16 tile GEMM for decode row counts (weights packed"
        " once in the tiles' layout).",
        "- `step_ops_cpu.cpp`: per-layer step ops: cache write, rotary, RMSNorm(+residual),"
        " Gemma RMSNorm, SwiGLU, GeGLU, greedy argmax.",
        "- `decode_stack_cpu.cpp`: DecodeStack, a Llama-family decode step's layers in one call"
        " (the same kernels, in order, as the Python layers; Qwen3's q/k norms and sparse MoE"
        " layers too), plus each row's LoRA delta.",
        "- `decode_linear_cpu.h`: DecodeLinear, one packed linear layer on the kernel the tuner"
        " chose, as the decode stack and the fused MoE block call it.",
        "- `moe_cpu.cpp`: the fused sparse MoE block: (token, expert) pairs sorted by expert,"
        " each active expert's gate/up, SwiGLU and down on its kernel, the weighted sum in"
        " expert order.",
        "- `moe_cpu.h`: the MoEExperts class and the router's top-k, declared for the decode"
        " stack.",
        "- `lora_cpu.cpp`: batched LoRA for decode-sized steps: each row's own slot's shrink"
        " and expand, the rows of a slot in blocks sharing each weight load.",
        "- `kv_gather_cpu.cpp`: whole blocks of an fp8 or u8 KV cache gathered through a block"
        " list, dequantized as they are copied.",
        "- `shm_collectives_cpu.cpp`: the tensor-parallel ranks' shared-memory all-reduce and"
        " logits gather, one call each.",
        "- `ops_cpu.h`: the declarations of the extension's entry points shared by its files.",
        "- `amx_cpu.h`: AMX helpers shared by the tile kernels (the tile configuration).",
        "- `claims_cpu.h`: work split by claims: threads take the next few items from a shared"
        " counter.",
        "- `vec_cpu.h`: the vector layer over at::vec: fp32/bf16 loads and stores, exp,"
        " horizontal sums, one version per ISA.",
        "- `preload`: `cpuid_cap.c`, not part of the extension: a preload library that answers"
        " CPUID as the PAGEDATTN_CPU_ISA-capped CPU would (pagedattn.cpu.cpuid_cap).",
        "",
    ]
    listed = {line.split("`")[1] for line in lines if line.startswith("- `")}
    missing = sorted(p.name for p in (ROOT / "pagedattn" / "csrc").iterdir())
    missing = [name for name in missing if name not in listed]
    if missing:
        raise SystemExit(f"scripts/structures.py: describe {', '.join(missing)}")
    sys.stdout.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
