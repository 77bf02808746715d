"""Runners of the real CPU engines (OpenVINO GenAI, vLLM's CPU build), each run by its own venv.

These modules import nothing from pagedattn: the peer's venv runs them by path, e.g.
``.venv-openvino/bin/python .../cpu_peers/openvino_runner.py job.json result.json``.
"""
