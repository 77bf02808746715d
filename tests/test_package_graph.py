"""The package graph stays a tree of layers: no import cycle among pagedattn's subpackages through
module-level imports, lower layers never import higher ones, and no package file passes 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedattn"
# The floors, lowest first (STYLE.md); a subpackage may import only its own floor or lower ones.
# Rooms on one floor must not import each other in a circle (checked separately).
LAYERS = [
    {
        "envs",
        "sampling_params",
        "chat_template",
        "tokenizer",
        "disk_cache",
        "metrics",
        "structured_output",
    },
    {"core"},
    {"config"},
    {"cpu", "distributed"},
    {"attention", "kv_transfer"},
    {"lora", "model", "spec_decode"},
    {"worker"},
    {"engine", "sim"},
    {"entrypoints", "viz"},
    {"serve"},
    {"benchmarks", "cli"},
]
FLOOR = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
MAX_LINES = 600


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "pagedattn" or len(parts) < 2:
        return None
    return parts[1]


def module_level_imports(path: Path) -> set[str]:
    """Modules a file imports at module level (not inside functions; TYPE_CHECKING excluded)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                test = node.test
                name = getattr(test, "id", None) or getattr(test, "attr", None)
                if name == "TYPE_CHECKING":
                    visit(node.orelse)
                    continue
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def room_edges() -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> the files that make that edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        src = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem
        if src == "__init__":
            continue
        for module in module_level_imports(path):
            dst = room_of(module)
            if dst is None or dst == src or dst == "__init__":
                continue
            if not (PACKAGE / dst).exists() and not (PACKAGE / f"{dst}.py").exists():
                continue  # NOTE: `from pagedattn import LLM` names an attribute, not a room
            edges.setdefault((src, dst), []).append(str(rel))
    return edges


def test_every_room_has_a_floor():
    rooms = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    rooms |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert rooms - FLOOR.keys() == set(), "a new room needs a floor in LAYERS"


def test_no_import_runs_up_the_floors():
    upward = {
        f"{src} -> {dst}": files
        for (src, dst), files in room_edges().items()
        if FLOOR[dst] > FLOOR[src]
    }
    assert upward == {}


def test_no_cycle_among_rooms():
    graph: dict[str, set[str]] = {}
    for src, dst in room_edges():
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node, [node])
    assert cycles == []


def test_core_imports_no_other_room_but_the_bottom_floor():
    outside = {dst for (src, dst) in room_edges() if src == "core" and FLOOR[dst] > 0}
    assert outside == set()


def test_distributed_imports_neither_front_door():
    bad = {dst for (src, dst) in room_edges() if src == "distributed"}
    assert bad & {"entrypoints", "serve", "engine", "worker"} == set()


def test_no_package_file_over_600_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in PACKAGE.rglob("*")
        if p.suffix in (".py", ".cpp", ".h") and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_graph_checker_sees_an_upward_import(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text(
        "import os\nfrom pagedattn.serve import replica\nif TYPE_CHECKING:\n"
        "    from pagedattn.cli import main\ndef f():\n    from pagedattn.engine import llm\n"
    )
    found = module_level_imports(sample)
    assert "pagedattn.serve.replica" in found
    assert not any(m.startswith(("pagedattn.cli", "pagedattn.engine")) for m in found)
