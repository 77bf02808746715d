"""Parallel primitives under the worker: process groups, shared-memory collectives, CPU binding,
KV cache events over ZMQ and the keys of their sockets."""
