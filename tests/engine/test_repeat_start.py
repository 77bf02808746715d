"""A repeat start of a GGUF model does not import transformers, and answers as the first start did.

The first start converts the file's config and tokenizer with transformers and caches them; the
second reads the cache. Each start is a fresh process, as a user's would be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.model.gguf_writer import write_gguf
from tests.model.tiny import make_tiny_llama

# Modules a repeat start of `generate` does not need (each costs 0.05-1.5 s to import). The
# gguf package is imported here all the same: this tiny file is under WEIGHT_CACHE_MIN_BYTES, so
# its weights are dequantised (by gguf) on every start rather than cached.
NOT_IMPORTED = ("transformers", "huggingface_hub", "sympy", "xgrammar", "fastapi", "ray")

START = """
import json, sys
from pagedattn import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", num_blocks=32, block_size=4)
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
chat = llm.chat([{"role": "user", "content": "the cat is on a w5"}], params)[0]
raw = llm.generate(["to be, or not to be"], params)[0]
print(json.dumps({
    "modules": [m for m in sys.argv[2:] if m in sys.modules],
    "tokenizer": type(llm.tokenizer).__name__,
    "chat": [chat.prompt, chat.prompt_token_ids, chat.outputs[0].token_ids, chat.outputs[0].text],
    "raw": [raw.prompt_token_ids, raw.outputs[0].token_ids, raw.outputs[0].text],
}))
"""


def _start(gguf: Path, cache: Path) -> dict:
    env = dict(os.environ, PAGEDATTN_CACHE_DIR=str(cache))
    env.pop("PAGEDATTN_WEIGHT_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-c", START, str(gguf), *NOT_IMPORTED],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_repeat_start_skips_transformers(tmp_path: Path) -> None:
    gguf = write_gguf(make_tiny_llama(tmp_path / "hf"), tmp_path / "tiny.gguf", "llama")
    cache = tmp_path / "cache"
    first = _start(gguf, cache)
    assert "transformers" in first["modules"]  # the conversion
    second = _start(gguf, cache)
    assert second["modules"] == []
    assert first["tokenizer"] == second["tokenizer"] == "LightTokenizer"
    assert second["chat"] == first["chat"] and second["raw"] == first["raw"]
    assert first["chat"][0].startswith("<|im_start|> user the cat")
    assert len(second["raw"][1]) == 8
