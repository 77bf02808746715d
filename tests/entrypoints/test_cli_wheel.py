"""An installed wheel runs `pagedattn bench NAME`: the benchmarks ship inside the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pagedattn.benchmarks

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_every_benchmark_and_runs_one_outside_the_checkout(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "pagedattn", src / "pagedattn", ignore=shutil.ignore_patterns("__pycache__")
    )
    pip = [sys.executable, "-m", "pip", "-q"]
    # NOTE: no network: the build uses the installed setuptools and installs no dependency.
    subprocess.run(
        [
            *pip,
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=src,
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("pagedattn-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = Path(pagedattn.benchmarks.__file__).parent
    for module in package.glob("*.py"):
        assert f"pagedattn/benchmarks/{module.name}" in names

    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
    )
    work = tmp_path / "work"
    work.mkdir()
    code = (
        "import sys, pagedattn; from pagedattn.cli import main; "
        "print('package:', pagedattn.__file__); sys.exit(main(sys.argv[1:]))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, "bench", "allocator", "--num-requests", "10"],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert f"package: {site}" in res.stdout
    assert "| p50 us per call |" in res.stdout
