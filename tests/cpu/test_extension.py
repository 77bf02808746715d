"""The compiled CPU paged-decode kernel against dense attention and the torch reference backend.

The first run compiles the extension (about a minute; cached under ~/.cache/pagedattn/ext). A
failed build fails these tests: this machine and CI have g++ and ninja.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pagedattn.attention.backends import get_attn_backend
from pagedattn.attention.backends.cpu import CpuBackend
from pagedattn.cpu import extension as cpu_ext
from tests.attention.paged_case import assert_matches_dense, dense_reference, make_case, mixed_specs

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCES = {torch.float32: 2e-4, torch.bfloat16: 3e-2}
# Small partitions split every row, so the log-sum-exp merge is exercised on short contexts.
PARTITION_SIZES = [cpu_ext.DEFAULT_PARTITION_SIZE, 16]


@pytest.fixture(scope="module", autouse=True)
def extension():
    return cpu_ext.load_extension()  # raises (fails the tests) if the build fails


def decode_specs(block_size: int) -> list[tuple[int, int]]:
    """Decode rows around block boundaries, one past a chunk (64 tokens) and one of length 1."""
    return [(5 * block_size + 3, 1), (3 * block_size - 1, 1), (block_size + 1, 1), (1, 1), (150, 1)]


def run_decode(case, *, partition_size=cpu_ext.DEFAULT_PARTITION_SIZE, **kwargs) -> torch.Tensor:
    meta = case.metadata
    return cpu_ext.paged_decode(
        case.query,
        case.key_cache,
        case.value_cache,
        meta.block_tables,
        meta.seq_lens,
        partition_size=partition_size,
        **kwargs,
    )


def assert_close_to_dense(case, out, **kwargs) -> None:
    expected = dense_reference(case, **kwargs)
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    atol = TOLERANCES[case.query.dtype]
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (3, 3), (1, 8)])
@pytest.mark.parametrize("partition_size", PARTITION_SIZES)
def test_decode_matches_dense(dtype, block_size, num_kv_heads, group, partition_size):
    case = make_case(
        decode_specs(block_size),
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_size=64,
        dtype=dtype,
        seed=block_size + group,
    )
    out = run_decode(case, partition_size=partition_size, scale=0.125)
    assert_close_to_dense(case, out, scale=0.125)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [48, 128])
@pytest.mark.parametrize(
    "options",
    [
        dict(sliding_window=7),
        dict(sliding_window=100),
        dict(logits_soft_cap=2.0),
        dict(sliding_window=1, logits_soft_cap=5.0),
    ],
)
def test_window_softcap_head_sizes(dtype, head_size, options):
    # head_size 48 leaves a 16-element tail after the 32-wide bf16 dot products.
    case = make_case(
        decode_specs(16), block_size=16, num_kv_heads=2, group=3, head_size=head_size, dtype=dtype
    )
    for partition_size in PARTITION_SIZES:
        out = run_decode(case, partition_size=partition_size, scale=0.3, **options)
        assert_close_to_dense(case, out, scale=0.3, **options)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_long_rows_match_torch_reference(dtype, num_threads):
    # Long, uneven rows: several 512-token partitions per row, balanced across threads.
    specs = [(1300, 1), (700, 1), (64, 1), (513, 1)]
    case = make_case(specs, block_size=16, num_kv_heads=2, group=4, head_size=64, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = run_decode(case, scale=0.125)
    finally:
        torch.set_num_threads(before)
    reference = get_attn_backend("torch").forward(
        case.query, case.key_cache, case.value_cache, case.metadata, scale=0.125
    )
    atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), reference.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_backend_uses_kernel_in_mixed_batches(dtype, block_size):
    backend = CpuBackend(use_extension=True)
    assert backend.uses_extension
    case = make_case(
        mixed_specs(block_size), block_size=block_size, num_kv_heads=2, group=3, dtype=dtype
    )
    assert_matches_dense(backend, case)
    assert_matches_dense(backend, case, sliding_window=5, logits_soft_cap=3.0)
    decode = make_case(decode_specs(block_size), block_size=block_size, num_kv_heads=2, group=3)
    assert decode.metadata.is_pure_decode
    assert_matches_dense(backend, decode)


def test_padding_table_entries_are_not_read():
    case = make_case([(24, 1), (9, 1)], block_size=8, num_kv_heads=2, group=3, head_size=32)
    tables = case.metadata.block_tables
    tables[1, 2:] = -1  # past seq_len 9 (2 blocks of 8): never dereferenced
    out = run_decode(case, scale=0.17)
    assert_close_to_dense(case, out, scale=0.17)


def test_bad_block_id_raises():
    case = make_case([(24, 1), (9, 1)], block_size=8, num_kv_heads=2, group=3, head_size=32)
    case.metadata.block_tables[0, 1] = case.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="block table entry"):
        run_decode(case, scale=0.17)
    case.metadata.block_tables[0, 1] = -1
    with pytest.raises(RuntimeError, match="block table entry"):
        run_decode(case, scale=0.17)


@pytest.mark.parametrize("amx", [False, True])
def test_bad_block_id_in_the_next_items_first_chunk_raises(amx):
    """A thread prefetches its next item's first chunk during the current item's last chunk: a
    bad id there is skipped by the prefetch (not read), and that item itself reports it. One
    thread, so row 1 (shorter, so later) is row 0's next item. amx runs the tile path where the
    CPU has it, else the vector path."""
    case = make_case([(200, 1), (40, 1)], block_size=16, num_kv_heads=2, group=3, head_size=64,
                     dtype=torch.bfloat16)  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert_close_to_dense(case, run_decode(case, scale=0.17, amx=amx), scale=0.17)
        case.metadata.block_tables[1, 0] = 1 << 30
        with pytest.raises(RuntimeError, match="block table entry"):
            run_decode(case, scale=0.17, amx=amx)
    finally:
        torch.set_num_threads(before)


def test_rejects_mismatched_inputs():
    case = make_case([(10, 1)], block_size=8, num_kv_heads=2, group=3, head_size=32)
    with pytest.raises(RuntimeError, match="share one dtype"):
        cpu_ext.paged_decode(
            case.query.double(),
            case.key_cache,
            case.value_cache,
            case.metadata.block_tables,
            case.metadata.seq_lens,
            scale=1.0,
        )
    with pytest.raises(RuntimeError, match="seq_len"):
        cpu_ext.paged_decode(
            case.query,
            case.key_cache,
            case.value_cache,
            case.metadata.block_tables,
            torch.tensor([17], dtype=torch.int32),  # 2 blocks of 8 hold at most 16
            scale=1.0,
        )
    assert not cpu_ext.supports(case.query.double(), case.key_cache)
    assert not cpu_ext.supports(case.query[..., :24], case.key_cache)


def test_build_failure_falls_back_once(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_ext, "_module", None)
    monkeypatch.setattr(cpu_ext, "_error", None)
    monkeypatch.setattr(cpu_ext, "SOURCES", (tmp_path / "missing.cpp",))
    with pytest.raises(cpu_ext.ExtensionBuildError, match="missing.cpp"):
        cpu_ext.load_extension()
    with caplog.at_level(logging.WARNING, logger=cpu_ext.__name__):
        assert cpu_ext.get_extension() is None
        assert cpu_ext.get_extension() is None
    assert len(caplog.records) == 1 and "PyTorch path" in caplog.records[0].getMessage()
    backend = CpuBackend()
    assert not backend.uses_extension
    case = make_case(decode_specs(8), block_size=8, num_kv_heads=2, group=3)
    assert_matches_dense(backend, case)


def test_disable_env_turns_kernel_off(monkeypatch):
    monkeypatch.setenv("PAGEDATTN_DISABLE_CPU_EXT", "1")
    assert cpu_ext.get_extension() is None
    assert not CpuBackend().uses_extension
    monkeypatch.delenv("PAGEDATTN_DISABLE_CPU_EXT")
    assert CpuBackend().uses_extension


needs_amx = pytest.mark.skipif(not cpu_ext.amx_available(), reason="no AMX-BF16 on this CPU")


@needs_amx
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (2, 1), (1, 16)])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("partition_size", PARTITION_SIZES)
def test_amx_decode_matches_dense(num_kv_heads, group, head_size, partition_size):
    specs = [*decode_specs(16), (700, 1), (64, 1)]
    case = make_case(
        specs,
        block_size=16,
        num_kv_heads=num_kv_heads,
        group=group,
        head_size=head_size,
        dtype=torch.bfloat16,
        seed=group,
    )
    # Blocks no table references hold NaN: the tiles read whole blocks, never other ones.
    referenced = set(case.metadata.block_tables.flatten().tolist())
    for block in range(case.key_cache.shape[0]):
        if block not in referenced:
            case.key_cache[block] = float("nan")
            case.value_cache[block] = float("nan")
    for options in (dict(), dict(logits_soft_cap=2.0)):
        out = run_decode(case, partition_size=partition_size, scale=0.125, amx=True, **options)
        assert_close_to_dense(case, out, scale=0.125, **options)
        vector = run_decode(case, partition_size=partition_size, scale=0.125, **options)
        assert not torch.equal(out, vector)  # the tiles' path ran (probabilities in bf16)
        torch.testing.assert_close(out.float(), vector.float(), atol=2e-2, rtol=2e-2)


@needs_amx
@pytest.mark.parametrize(
    "block_size,head_size,options",
    [(8, 64, {}), (16, 48, {}), (16, 64, dict(sliding_window=40))],
    ids=["block-8", "head-48", "sliding-window"],
)
def test_amx_decode_falls_back_where_the_tiles_do_not_fit(block_size, head_size, options):
    case = make_case(
        decode_specs(block_size),
        block_size=block_size,
        num_kv_heads=2,
        group=3,
        head_size=head_size,
        dtype=torch.bfloat16,
    )
    amx = run_decode(case, scale=0.125, amx=True, **options)
    assert torch.equal(amx, run_decode(case, scale=0.125, **options))  # the vector path, exactly


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, monkeypatch):
    # torch's build lock is a plain file: a build killed midway left it, and every later build
    # waited on it forever.
    monkeypatch.setenv("PAGEDATTN_EXT_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_ext, "_module", None)
    monkeypatch.setattr(cpu_ext, "_module_isa", None)  # NOTE: restored, for the next tests' level
    monkeypatch.setattr(cpu_ext, "_error", None)
    built = []

    def fake_load(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        assert not (tmp_path / build_directory / "lock").exists()
        built.append(build_directory)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return "module"

    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    work_dir = cpu_ext.build_dir("native") / "build"
    work_dir.mkdir(parents=True)
    (work_dir / "lock").touch()  # left by a killed build
    assert cpu_ext.load_extension(isa="native") == "module"
    assert built == [str(work_dir)] and (work_dir.parent / f"{cpu_ext.EXTENSION_NAME}.so").exists()
