"""Benchmarks shipped in the package: `pagedattn bench NAME [options]` runs bench_NAME.py.

Every ``bench_*.py`` module here is a benchmark, found by name (a new one needs no registration);
each parses its own options, so `pagedattn bench NAME --help` prints that benchmark's options.
Results go under ./bench_out in the current directory unless a benchmark's --out says otherwise.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import runpy
import sys

_PREFIX = "bench_"
# Short names the CLI has always accepted for modules named otherwise.
_ALIASES = {"serve": "serving"}


def available() -> dict[str, str]:
    """Benchmark name -> module name, for every bench_*.py module in this package."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name.startswith(_PREFIX))
    found = {name.removeprefix(_PREFIX): f"{__name__}.{name}" for name in names}
    for alias, target in _ALIASES.items():
        if target in found:
            found[alias] = found.pop(target)
    return dict(sorted(found.items()))


def describe() -> dict[str, str]:
    """Benchmark name -> the first line of its module docstring (read without importing it)."""
    lines = {}
    for name, module in available().items():
        spec = importlib.util.find_spec(module)
        with open(spec.origin, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        lines[name] = doc.strip().splitlines()[0] if doc.strip() else ""
    return lines


def resolve(name: str) -> str:
    """The module of benchmark ``name`` (dashes or underscores); ValueError lists the names."""
    registry = available()
    key = name.replace("-", "_")
    key = {v: k for k, v in _ALIASES.items()}.get(key, key)
    if key not in registry:
        raise ValueError(f"no benchmark {name!r}: use one of {', '.join(registry)}")
    return registry[key]


def run(name: str, argv: list[str]) -> int:
    """Run benchmark ``name`` as `python -m` would, with ``argv`` as its options; its exit code."""
    module = resolve(name)
    saved = sys.argv
    # NOTE: argparse takes its prog from argv[0], so the benchmark's usage line reads as typed.
    sys.argv = [f"pagedattn bench {name}", *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0
