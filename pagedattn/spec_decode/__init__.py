"""Speculative decoding: draft proposers, exact verification, the on/off policy and counters."""
