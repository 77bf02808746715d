# `make demo`: set up and run the main job on the default model. `make test`: set up, lint, test.
.PHONY: setup demo test lint bench bench-peers

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/pagedattn generate

lint:
	.venv/bin/ruff format --check pagedattn tests
	.venv/bin/ruff check pagedattn tests

test: setup lint
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python -m pagedattn.benchmarks.bench_allocator

# The llama.cpp peer of `pagedattn bench throughput`: llama-cpp-python, compiled from source for
# this CPU (about 5 minutes on 2 cores). Optional: without it the benchmark skips llama.cpp.
bench-peers: setup
	CMAKE_ARGS="-DGGML_NATIVE=ON" .venv/bin/pip install "llama-cpp-python==0.3.36"
