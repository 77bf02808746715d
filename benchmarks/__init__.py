"""Benchmarks: python -m benchmarks.<name> --seed 0."""
