"""Only core/ writes a request's spec_token_ids: a drafter returns its drafts and the engine hands
them to Scheduler.update_draft_token_ids (vLLM v1's contract). Checked on the source with ast."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagedattn
from pagedattn.config import CacheConfig, SchedulerConfig
from pagedattn.core.kv_cache_manager import KVCacheManager
from pagedattn.core.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec
from pagedattn.core.request import Request
from pagedattn.core.scheduler import Scheduler

PACKAGE = Path(pagedattn.__file__).resolve().parent
FIELD = "spec_token_ids"
MUTATORS = {
    "append",
    "extend",
    "clear",
    "insert",
    "pop",
    "remove",
    "sort",
    "reverse",
    "__setitem__",
}


def _is_field(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == FIELD


def _writes_target(target: ast.AST) -> bool:
    """x.spec_token_ids, x.spec_token_ids[...] (item or slice), or either inside a tuple."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_writes_target(t) for t in target.elts)
    if isinstance(target, ast.Starred):
        return _writes_target(target.value)
    return _is_field(target) or (isinstance(target, ast.Subscript) and _is_field(target.value))


def spec_token_writes(source: str) -> list[int]:
    """Line numbers of the statements in source that assign or mutate a .spec_token_ids."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign):
            hit = any(_writes_target(t) for t in node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            hit = _writes_target(node.target)
        elif isinstance(node, ast.Delete):
            hit = any(_writes_target(t) for t in node.targets)
        elif isinstance(node, ast.Call):
            func = node.func
            mutator = (
                isinstance(func, ast.Attribute) and func.attr in MUTATORS and _is_field(func.value)
            )
            named = (
                isinstance(func, ast.Name)
                and func.id in ("setattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == FIELD
            )
            hit = mutator or named
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize(
    "statement",
    [
        "r.spec_token_ids = list(d)",
        "r.spec_token_ids: list = []",
        "a, r.spec_token_ids = 1, []",
        "r.spec_token_ids += [1]",
        "r.spec_token_ids[1:] = []",
        "r.spec_token_ids[0] = 7",
        "del r.spec_token_ids[2:]",
        "r.spec_token_ids.append(1)",
        "r.spec_token_ids.extend(d)",
        "r.spec_token_ids.clear()",
        "setattr(r, 'spec_token_ids', d)",
    ],
)
def test_every_kind_of_write_is_found(statement):
    assert spec_token_writes(f"def f(r, d):\n    {statement}\n") == [2]


def test_reads_are_not_writes():
    source = (
        "n = len(r.spec_token_ids)\n"
        "d = list(r.spec_token_ids)\n"
        "if r.spec_token_ids: t = r.spec_token_ids[0]\n"
        "s = ScheduledRequest(spec_token_ids=tuple(d))\n"
    )
    assert spec_token_writes(source) == []


def test_only_core_writes_spec_token_ids():
    core = PACKAGE / "core"
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if core in path.parents:
            continue
        for line in spec_token_writes(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert not offenders, (
        "only pagedattn/core writes spec_token_ids; return drafts and hand them to "
        f"Scheduler.update_draft_token_ids instead: {offenders}"
    )


def test_drafts_reach_running_decoding_requests_only():
    groups = [KVCacheGroupSpec(("layers.0",), FullAttentionSpec(block_size=4))]
    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        CacheConfig(block_size=4, num_blocks=16),
        KVCacheManager(groups, 16),
        max_model_len=64,
    )
    a = Request("a", [1, 2, 3], max_tokens=8, block_size=4)
    b = Request("b", [4, 5, 6], max_tokens=8, block_size=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    scheduler.update_draft_token_ids({"a": [9, 9]})  # still waiting: ignored
    assert a.spec_token_ids == []
    scheduler.schedule()  # both prompts computed; neither has sampled yet
    assert [r.req_id for r in scheduler.decoding_requests()] == []
    a.append_output_token_ids(7)
    (view,) = scheduler.decoding_requests()
    assert (view.req_id, list(view.token_ids), view.num_tokens) == ("a", [1, 2, 3, 7], 4)
    scheduler.update_draft_token_ids({"a": (8, 9), "gone": [1]})
    assert a.spec_token_ids == [8, 9] and b.spec_token_ids == []
