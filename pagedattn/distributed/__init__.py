"""Serving past one process: KV cache events over ZMQ, prefix-aware routing, Ray Serve replicas."""
