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
        "- `paged_attention_cpu.cpp`: CPU paged decode attention through the block tables (vector"
        " code on every ISA, AVX512-BF16 scores or AMX tiles for bf16), and the module's bindings.",
        "- `linear_cpu.cpp`: the panel GEMM, one of the linear kernels the tuner measures"
        " (panels, AMX, MKL, oneDNN, F.linear).",
        "- `linear_amx_cpu.cpp`: the AMX-BF16 tile GEMM for decode row counts (weights packed once"
        " in the tiles' layout).",
        "- `step_ops_cpu.cpp`: per-layer step ops: cache write, rotary, RMSNorm(+residual),"
        " Gemma RMSNorm, SwiGLU, GeGLU, greedy argmax.",
        "- `decode_stack_cpu.cpp`: DecodeStack, a Llama-family decode step's layers in one call"
        " (the same kernels, in order, as the Python layers).",
        "- `ops_cpu.h`: the declarations of the extension's entry points shared by its files.",
        "- `amx_cpu.h`: AMX helpers shared by the tile kernels (the tile configuration).",
        "- `vec_cpu.h`: the vector layer over at::vec: fp32/bf16 loads and stores, exp,"
        " horizontal sums, one version per ISA.",
        "",
    ]
    sys.stdout.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
