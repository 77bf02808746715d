"""ServeConfig: `pagedattn serve`'s options as one frozen, validated object built from the CLI."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagedattn.config import ConfigError
from pagedattn.entrypoints.args import HelpFormatter, add_serve_args
from pagedattn.entrypoints.serve_config import ServeConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_serve_args(parser)
    return parser.parse_args(list(argv))


def test_the_cli_builds_one_config_with_every_serve_option():
    args = parse(
        "--port", "8123", "--api-key", "a", "b", "--admin-api-key", "root",
        "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        "--reasoning-parser", "qwen3", "--data-parallel-size", "2", "--router", "pow2",
    )  # fmt: skip
    config = ServeConfig.from_cli(args)
    assert config.port == 8123 and config.api_key == ("a", "b")
    assert config.admin_api_key == ("root",) and config.admin_keys() == ["root"]
    assert (config.tool_call_parser, config.enable_auto_tool_choice) == ("hermes", True)
    assert config.reasoning_parser == "qwen3" and config.router == "pow2"
    assert config.uses_replicas and not ServeConfig.from_cli(parse()).uses_replicas
    assert ServeConfig.from_cli(parse()) == ServeConfig()  # the flags' defaults are the fields'
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"port": 99999}, r"--port 99999 is invalid: use a TCP port in 1\.\.65535"),
        ({"data_parallel_size": 0}, r"--data-parallel-size=0 is invalid: use >= 1"),
        ({"tool_call_parser": "nope"}, r"--tool-call-parser='nope' is invalid: use one of"),
        ({"router": "random"}, r"--router='random' is invalid: use one of prefix, pow2"),
        ({"health_stall_s": 0}, r"--health-stall-s=0 is invalid"),
        ({"max_request_bytes": 0}, r"--max-request-bytes=0 is invalid"),
        ({"replica_cpus": -1}, r"--replica-cpus=-1 is invalid"),
        ({"prefill_replicas": 1}, r"give both"),
    ],
)
def test_a_bad_value_is_refused_naming_the_option(options, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**options)


def test_api_keys_fall_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_API_KEY", "k1,k2")
    assert ServeConfig().api_keys() == ["k1", "k2"]
    assert ServeConfig(api_key=["x"]).api_keys() == ["x"]
