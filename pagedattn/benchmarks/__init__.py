"""Benchmarks: python -m pagedattn.benchmarks.<name> --seed 0."""
