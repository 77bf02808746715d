"""Trace-driven KV cache memory simulation: paged allocation beside contiguous baselines."""
