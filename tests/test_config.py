"""Engine options are written once (pagedattn.config): the CLI flags and LLM's keywords follow."""

from __future__ import annotations

import argparse

import pytest

import pagedattn
from pagedattn.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    engine_options,
)
from pagedattn.entrypoints.args import add_engine_args


def _parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return EngineConfig.from_cli(parser.parse_args(list(argv)))


def _get(config: EngineConfig, name: str):
    opt = engine_options()[name]
    section = config if opt.section is None else getattr(config, opt.section)
    return getattr(section, opt.field.name)


# Options refused alone (they apply beside another): the companion they are tested with.
COMPANIONS = {"calculate_kv_scales": {"kv_cache_dtype": "fp8"}}


def _other_value(name: str):
    """A valid value different from the option's default, as (python value, CLI argv)."""
    opt = engine_options()[name]
    flag = opt.field.metadata["flags"][:1] or (f"--{name.replace('_', '-')}",)
    default, choices = opt.field.default, opt.field.metadata["choices"]
    if opt.value_type is bool:
        return (not default), [f"--{'no-' if default else ''}{flag[0][2:]}"]
    if choices:
        value = next(c for c in choices if c != default)
    elif name == "device":
        value = "cuda:1"
    elif opt.value_type is int:
        value = 7 if default is None else default + 1
    elif opt.value_type is float:
        value = 0.125 if default is None else default / 2
    else:
        value = "somewhere/else"
    return value, [flag[0], str(value)]


def test_cli_without_flags_gives_the_dataclass_defaults():
    assert _parse() == EngineConfig()
    assert EngineConfig.from_kwargs() == EngineConfig()


@pytest.mark.parametrize("name", list(engine_options()))
def test_each_option_is_one_keyword_and_one_flag_setting_the_same_field(name):
    value, argv = _other_value(name)
    # NOTE: an option that only applies beside another one gets that one too.
    companion = COMPANIONS.get(name, {})
    from_kwargs = EngineConfig.from_kwargs(**{name: value}, **companion)
    assert _get(from_kwargs, name) == value
    assert from_kwargs != EngineConfig.from_kwargs(**companion)
    companion_argv = [a for k, v in companion.items() for a in (f"--{k.replace('_', '-')}", v)]
    assert _parse(*argv, *companion_argv) == from_kwargs


def test_options_land_in_their_sections():
    config = EngineConfig.from_kwargs(
        model="m", dtype="bfloat16", block_size=32, max_num_seqs=4, num_threads=2
    )
    assert config.model == ModelConfig(model="m", dtype="bfloat16")
    assert config.cache.block_size == 32
    assert config.scheduler.max_num_seqs == 4
    assert config.num_threads == 2


def test_flag_names_users_already_type_keep_working():
    config = _parse(
        "--no-prefix-caching",
        "--no-chunked-prefill",
        "--threads",
        "3",
        "--kv-cache-memory",
        "1GiB",
        "--dtype",
        "float16",
        "--device",
        "cuda",
        "--attn-backend",
        "torch",
        "--kv-cache-memory-fraction",
        "0.5",
    )
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.enable_chunked_prefill is False
    assert config.num_threads == 3
    assert config.cache.kv_cache_memory == 2**30
    assert config.model.dtype == "float16" and config.model.device == "cuda"
    assert config.attn_backend == "torch"
    assert config.cache.kv_cache_memory_fraction == 0.5


def test_kv_cache_memory_takes_bytes_or_a_size_string():
    assert CacheConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 * 2**20
    assert EngineConfig.from_kwargs(kv_cache_memory=4096).cache.kv_cache_memory == 4096
    with pytest.raises(ConfigError, match="cannot parse size '2XB'"):
        EngineConfig.from_kwargs(kv_cache_memory="2XB")


def test_unknown_keyword_names_itself_and_the_allowed_ones():
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_kwargs(blocksize=16, block_size=16)
    message = str(info.value)
    assert "'blocksize'" in message
    assert all(name in message for name in engine_options())


def test_bad_values_name_the_field_and_what_is_allowed():
    with pytest.raises(ConfigError, match=r"dtype='fp8' is invalid: use one of 'auto', 'float32'"):
        EngineConfig.from_kwargs(dtype="fp8")
    with pytest.raises(ConfigError, match="policy='lifo'"):
        EngineConfig.from_kwargs(policy="lifo")
    with pytest.raises(ConfigError, match="block_size=0"):
        EngineConfig.from_kwargs(block_size=0)
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype", "int8")


def test_dtype_defaults_to_auto():
    assert ModelConfig().dtype == "auto"
    assert EngineConfig.from_kwargs(dtype="auto").model.dtype == "auto"


def test_every_option_has_help_and_says_what_none_means():
    for opt in engine_options().values():
        assert opt.field.metadata["help"], opt.name
        if opt.field.default is None:
            assert opt.field.metadata["default_text"], f"{opt.name}: say what None means"


def test_llm_rejects_an_unknown_option_before_loading_a_model():
    from pagedattn import LLM

    with pytest.raises(ConfigError, match="'blocksize'"):
        LLM("/no/such/model", blocksize=16)
    for name in engine_options():
        assert f"{name}:" in LLM.__init__.__doc__


def test_public_api_exports_its_own_types():
    from pagedattn import (  # noqa: F401
        LLM,
        BeamSearchParams,
        ConfigError,
        EngineConfig,
        InvalidRequestError,
        InvalidSamplingParamsError,
        LLMEngine,
        ModelNotFoundError,
        RequestOutput,
        SamplingParams,
    )

    for name in pagedattn.__all__:
        assert isinstance(getattr(pagedattn, name), type), name
    assert issubclass(ModelNotFoundError, Exception) and issubclass(ConfigError, ValueError)
    with pytest.raises(AttributeError):
        pagedattn.NoSuchThing  # noqa: B018


def test_lora_with_tensor_parallelism_is_refused_before_any_model_loads():
    with pytest.raises(ConfigError, match="enable_lora with tensor_parallel_size=2"):
        EngineConfig.from_kwargs(enable_lora=True, tensor_parallel_size=2)
    assert EngineConfig.from_kwargs(enable_lora=True).lora.enable_lora


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(calculate_kv_scales=True), "applies to an fp8 KV cache"),
        (
            dict(calculate_kv_scales=True, kv_cache_dtype="fp8", kv_store="file:///tmp/x"),
            "with a kv_store is not supported",
        ),
    ],
)
def test_calculated_fp8_scales_are_refused_where_they_would_do_nothing_or_harm(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_kwargs(**kwargs)
    assert EngineConfig.from_kwargs(calculate_kv_scales=True, kv_cache_dtype="fp8_e5m2")
