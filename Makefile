# `make demo`: set up and run the main job on the default model. `make test`: set up, lint, test.
.PHONY: setup demo test lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/pagedattn generate

lint:
	.venv/bin/ruff format --check pagedattn tests benchmarks
	.venv/bin/ruff check pagedattn tests benchmarks

test: setup lint
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/python -m benchmarks.bench_allocator
