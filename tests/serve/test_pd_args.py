"""`pagedattn serve --prefill-replicas P --decode-replicas D`: option checks (no Ray started)."""

from __future__ import annotations

import argparse

import pytest

from pagedattn.serve.args import (
    add_distributed_args,
    uses_replicas,
    validate_distributed_args,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_distributed_args(parser)
    return parser.parse_args(argv)


def test_prefill_and_decode_replicas_run_the_ray_app():
    args = parse("--prefill-replicas", "1", "--decode-replicas", "2")
    assert uses_replicas(args)
    validate_distributed_args(args)
    assert not uses_replicas(parse())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--prefill-replicas", "1"), "give both"),
        (("--decode-replicas", "2"), "give both"),
        (("--prefill-replicas", "-1", "--decode-replicas", "1"), "give both"),
        (
            ("--prefill-replicas", "1", "--decode-replicas", "1", "--data-parallel-size", "2"),
            "two layouts",
        ),
        (
            ("--prefill-replicas", "1", "--decode-replicas", "1", "--pd-min-prompt-tokens", "-1"),
            "pd-min-prompt-tokens",
        ),
        (
            ("--prefill-replicas", "1", "--decode-replicas", "1", "--pd-decode-step-time", "0"),
            "pd-decode-step-time",
        ),
        (
            ("--prefill-replicas", "1", "--decode-replicas", "1", "--pd-prefill-nice", "20"),
            "pd-prefill-nice",
        ),
    ],
)
def test_half_a_layout_is_refused_with_the_fix(argv, message):
    with pytest.raises(ValueError, match=message):
        validate_distributed_args(parse(*argv))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--data-parallel-size", "2", "--enable-lora"), "LoRA adapters"),
        (("--prefill-replicas", "1", "--decode-replicas", "1", "--lora-modules", "a=/x"), "LoRA"),
        (("--prefill-replicas", "1", "--decode-replicas", "1", "-tp", "2"), "rank 0's shard"),
        (
            ("--prefill-replicas", "1", "--decode-replicas", "1", "--kv-cache-dtype", "fp8")
            + ("--calculate-kv-scales",),
            "its own fp8 scales",
        ),
        (("--prefill-replicas", "1", "--decode-replicas", "1", "--kv-cache-dtype", "u8"), "u8"),
    ],
)
def test_options_replicas_cannot_honour_are_refused_before_ray_starts(extra, message):
    """The serve parser as the CLI builds it: these would be dropped or wrong on replicas."""
    from pagedattn.cli import build_parser

    args = build_parser().parse_args(["serve", *extra])
    with pytest.raises(ValueError, match=message):
        validate_distributed_args(args)
    one_process = [a for a in extra if a not in ("--data-parallel-size", "2")]
    if "--prefill-replicas" not in extra:  # the same options without replicas are fine
        validate_distributed_args(build_parser().parse_args(["serve", *one_process]))


PD = ("--prefill-replicas", "1", "--decode-replicas", "1")


@pytest.mark.parametrize(
    ("argv", "engine_options", "message"),
    [
        (("--router", "pow2"), {}, "--router='pow2' does not apply"),
        (("--router-imbalance-threshold", "3"), {}, "--router-imbalance-threshold=3 does not"),
        ((), {"kv_events_endpoint": "tcp://127.0.0.1:5557"}, "--kv-events-endpoint="),
        (
            ("--kv-events-replay-endpoint", "tcp://127.0.0.1:5558"),
            {},
            "--kv-events-replay-endpoint=",
        ),
    ],
)
def test_options_a_pd_layout_would_drop_are_refused(argv, engine_options, message):
    args = parse(*PD, *argv)
    vars(args).update(engine_options)  # NOTE: --kv-events-endpoint is an engine option
    with pytest.raises(ValueError, match=message):
        validate_distributed_args(args)
    args = parse(*argv)  # the same options without PD are fine
    vars(args).update(engine_options)
    validate_distributed_args(args)


def test_the_default_router_is_accepted_with_pd():
    args = parse(*PD, "--router", "prefix")
    args.kv_events_endpoint = None
    validate_distributed_args(args)
