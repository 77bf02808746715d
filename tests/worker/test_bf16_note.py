"""What the runner says about bfloat16 weights on a CPU without bf16 instructions."""

from __future__ import annotations

import logging

import pytest

from pagedattn.worker import model_runner


@pytest.mark.parametrize("panels, level", [(True, logging.INFO), (False, logging.WARNING)])
def test_bf16_without_hardware_warns_only_without_the_panel_gemm(
    monkeypatch, caplog, panels, level
):
    monkeypatch.setattr(model_runner, "kernel_available", lambda name, dtype: panels)
    with caplog.at_level(logging.INFO, logger=model_runner.logger.name):
        model_runner._note_bf16_without_hardware()
    (record,) = caplog.records
    assert record.levelno == level
    assert ("half of float32's bytes" in record.getMessage()) == panels
