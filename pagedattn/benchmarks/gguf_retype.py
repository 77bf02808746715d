"""A GGUF file in another weight type: every tensor dequantised, stored as F32, BF16 or F16.

The engine dequantises the shipped Q4_1 SmolLM2 to float32 (or bfloat16) at load, so llama.cpp on
the shipped file runs other arithmetic (its own quantised dot products) on other numbers. This
writes the same dequantised numbers in the engine's dtype, so that llama.cpp runs on the weights
and the dtype the engine runs on. Metadata (tokenizer, hyper-parameters) is copied unchanged;
1-D tensors (norm weights) stay F32, as llama.cpp's own converter keeps them. The file is written
once into ``~/.cache/pagedattn/gguf`` and reused.

    python -m pagedattn.benchmarks.gguf_retype MODEL.gguf --type bf16
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "pagedattn" / "gguf"
# --dtype of the benchmark (or a GGUF type name) -> GGUF type name.
TYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def gguf_type_name(dtype: str) -> str:
    """'float32' / 'f32' / 'F32' -> 'F32' (likewise bf16, f16); ValueError for anything else."""
    name = TYPE_NAMES.get(dtype, dtype.upper())
    if name not in TYPE_NAMES.values():
        raise ValueError(f"no GGUF type for {dtype!r}; use one of {', '.join(TYPE_NAMES)}")
    return name


def retyped_gguf(src: Path, dtype: str, cache_dir: Path | None = None) -> Path:
    """Path of ``src`` with its 2-D tensors in ``dtype``; written on first use, then reused."""
    import gguf

    type_name = gguf_type_name(dtype)
    cache_dir = cache_dir or DEFAULT_CACHE_DIR
    dest = cache_dir / f"{src.stem}.{type_name}.gguf"
    if dest.is_file() and dest.stat().st_mtime >= src.stat().st_mtime:
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    qtype = gguf.GGMLQuantizationType[type_name]
    file_type = {
        "F32": gguf.LlamaFileType.ALL_F32,
        "BF16": gguf.LlamaFileType.MOSTLY_BF16,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
    }[type_name]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dest.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        # NOTE: GGUF.* are the reader's virtual fields; the writer adds the architecture itself.
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, values)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(tensor.name, values.astype(np.float16))
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", type=Path, help="a .gguf file")
    p.add_argument("--type", default="f32", help="f32, bf16 or f16 (or float32, bfloat16, ...)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = p.parse_args(argv)
    print(retyped_gguf(args.model, args.type, args.cache_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
