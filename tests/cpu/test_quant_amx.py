"""The AMX-INT8 kernels of interleaved GGUF layers (csrc/quant_amx_cpu.h).

On a CPU without AMX the tile instructions are emulated (amx_emulator.h) and the kernels are held
bit for bit to the AVX-512 VNNI kernels; on an AMX CPU the extension's own tiles are held to the
AVX kernels through QuantLinear. Where neither runs, the switch stays off.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.cpp_extension import include_paths

from pagedattn.cpu import extension, features, tuner
from pagedattn.cpu.linear import QuantizedParts, pack_quantized
from pagedattn.cpu.quant import QuantizedTensor
from tests.cpu.test_quant_kernels import random_blocks

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "pagedattn" / "csrc"
EMULATED_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"}
ext = extension.get_extension()
needs_ext = pytest.mark.skipif(
    ext is None or not hasattr(ext, "QuantLinear"), reason="no compiled extension"
)


@pytest.mark.skipif(
    not EMULATED_FLAGS <= features.cpu_flags() or shutil.which("g++") is None,
    reason="the emulated build runs the kernels' AVX-512 VNNI code natively",
)
def test_tile_kernels_match_the_vnni_kernels_bit_for_bit(tmp_path):
    """Q4_K, Q6_K and Q8_0 (an odd block count too), 16-48 activation rows: the tiles'
    products, scaled per sub-block, give the VNNI kernels' floats exactly."""
    binary = tmp_path / "quant_amx_emulated"
    includes = [f"-I{p}" for p in include_paths()]
    build = subprocess.run(
        ["g++", "-std=c++17", "-O2", "-march=native", "-ffp-contract=off",
         "-DCPU_CAPABILITY_AVX512", "-DPAGEDATTN_AMX_EMULATE", f"-I{CSRC}", f"-I{HERE}",
         *includes, str(HERE / "quant_amx_emulated.cpp"), "-o", str(binary)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    cases = [line for line in lines if line.startswith("type ")]
    assert len(cases) == 12 and all(" 0 of " in line for line in cases), run.stdout


@needs_ext
def test_amx_switch_keeps_outputs():
    """A layer packed to run the tiles from 1 row gives the AVX kernels' outputs bit for bit at
    every row count (rows past the tiles' sixteens, an odd x8 group left to the AVX kernel). On
    a CPU without AMX the switch is ignored: the build must not claim tiles it lacks."""
    if "amx_int8" not in features.cpu_flags():
        assert not extension.quant_amx_available()
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for type_id, cols in ((12, 512), (14, 512), (8, 96)):  # Q4_K, Q6_K, Q8_0
        raw = torch.from_numpy(random_blocks(type_id, 40, cols, rng))  # 5 x8 groups
        parts = QuantizedParts((QuantizedTensor(type_id, raw, cols),), (0,), 40, cols)
        avx = pack_quantized(parts, None, 1 << 30)
        tiles = pack_quantized(parts, None, 1 << 30, amx_rows=1)
        for rows in (1, 16, 37):
            x = torch.randn(rows, cols, generator=gen)
            assert torch.equal(avx(x), tiles(x)), (type_id, rows)


@needs_ext
@pytest.mark.parametrize(("amx_wins_from", "chosen"), [(1, 32), (None, 0)])
def test_amx_switch_is_the_first_row_count_where_tiles_win(monkeypatch, amx_wins_from, chosen):
    """tune_quant_amx_rows times the interleaved layer on the AVX kernels against the tiles at
    rising row counts and stops at the first where the tiles are no slower (0: never); without
    tiles it measures nothing."""
    if not extension.quant_amx_available():
        assert tuner.tune_quant_amx_rows([(64, 512)]) == (0, {})
    monkeypatch.setattr(extension, "quant_amx_available", lambda: True)
    timed: list[int] = []

    def fake_passes(passes):
        assert set(passes) == {"avx", "amx"}
        for one_pass in passes.values():
            one_pass()
        i = len(timed)
        timed.append(i)
        return {"avx": 1.0, "amx": 0.5 if amx_wins_from is not None and i >= amx_wins_from else 2.0}

    monkeypatch.setattr(tuner, "fastest_passes", fake_passes)
    rows, times = tuner.tune_quant_amx_rows([(96, 64), (64, 512)])
    assert rows == chosen
    stop = len(tuner.QUANT_SPLIT_ROWS) if amx_wins_from is None else amx_wins_from + 1
    assert list(times) == [f"q4_k_x8_rows_{r}" for r in tuner.QUANT_SPLIT_ROWS[:stop]]
