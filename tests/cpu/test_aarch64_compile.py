"""Every C++ source compiles for aarch64 (NEON through at::vec) with this torch's headers.

Debian's g++-aarch64-linux-gnu (installed by scripts/setup.sh) checks the syntax and types of
each translation unit, bindings included, without linking; the test skips only where that cross
compiler is missing.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from pagedattn.cpu import extension as cpu_ext

pytestmark = pytest.mark.skipif(
    shutil.which(cpu_ext.AARCH64_CROSS_COMPILER) is None,
    reason=f"{cpu_ext.AARCH64_CROSS_COMPILER} is not installed (apt-get install "
    "g++-aarch64-linux-gnu)",
)


def test_every_source_compiles_for_aarch64():
    # NOTE: all sources at once (each takes ~20 s of CPU), so two cores halve the wall time.
    procs = {
        source.name: subprocess.Popen(
            cpu_ext.aarch64_syntax_check_command(source),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for source in cpu_ext.SOURCES
    }
    failures = {}
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failures[name] = output[-3000:]
    assert not failures, "\n".join(f"{name}:\n{out}" for name, out in failures.items())


def test_the_vector_layer_picks_neon():
    # vec_cpu.h's isa_name() and kWidth on aarch64: at::vec's 128-bit NEON vectors.
    source = cpu_ext.CSRC / "vec_cpu.h"
    probe = (
        f'#include "{source}"\n'
        'static_assert(pagedattn_vec::kWidth == 4, "NEON holds 4 fp32 lanes");\n'
        "static_assert(pagedattn_vec::kNumRegs == 32);\n"
    )
    command = [*cpu_ext.aarch64_syntax_check_command(source)[:-1], "-x", "c++", "-"]
    result = subprocess.run(command, input=probe, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
