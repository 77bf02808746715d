"""MoE checkpoints pagedattn cannot run: one error naming what is wrong, at load."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from pagedattn.cli import main
from pagedattn.model.loader import load_model
from pagedattn.model.moe import MissingExpertError, MoECheckpointError, UnsupportedMoEError
from tests.model.test_moe_parity import make_tiny_mixtral, make_tiny_qwen3_moe


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


def _edit_weights(path, drop=(), add=None):
    tensors = load_file(path / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors |= add or {}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("maker", "name"),
    [
        (make_tiny_qwen3_moe, "model.layers.2.mlp.experts.5.up_proj.weight"),
        (make_tiny_mixtral, "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ],
)
def test_missing_expert_tensor_is_named(tmp_path, maker, name):
    path = maker(tmp_path)
    _edit_weights(path, drop=[name])
    with pytest.raises(MissingExpertError, match=r"experts\.\d\.\w+\.weight"):
        load_model(str(path))


def test_shared_expert_config_is_refused(tmp_path):
    path = make_tiny_qwen3_moe(tmp_path)
    _edit_config(path, shared_expert_intermediate_size=64)
    with pytest.raises(UnsupportedMoEError, match="shared_expert_intermediate_size"):
        load_model(str(path))


def test_shared_expert_tensor_is_refused(tmp_path):
    path = make_tiny_qwen3_moe(tmp_path)
    tensors = load_file(path / "model.safetensors")
    extra = {"model.layers.0.mlp.shared_expert.gate_proj.weight": tensors["lm_head.weight"]}
    _edit_weights(path, add=extra)
    with pytest.raises(UnsupportedMoEError, match=r"shared_expert\.gate_proj"):
        load_model(str(path))


def test_non_softmax_router_is_refused(tmp_path):
    path = make_tiny_mixtral(tmp_path)
    _edit_config(path, scoring_func="sigmoid")
    with pytest.raises(UnsupportedMoEError, match="scoring_func='sigmoid'"):
        load_model(str(path))


def test_cli_prints_one_line(tmp_path, capsys):
    path = make_tiny_qwen3_moe(tmp_path)
    _edit_weights(path, drop=["model.layers.0.mlp.experts.0.gate_proj.weight"])
    capsys.readouterr()
    assert main(["generate", "hi", "--model", str(path), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("pagedattn: error: checkpoint lacks expert tensor")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in last
    assert issubclass(MissingExpertError, MoECheckpointError)
