"""The README and docs/ stay true: links and #anchors resolve, named modules exist, flags are real.

`mkdocs build --strict` (in `make test`) checks the links between the docs site's pages; the
README sits outside the site, so its links are checked here, with GitHub's heading anchors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")


def _outside_fences(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _fenced(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif fenced:
            lines.append(line)
    return lines


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text, lowercased, punctuation dropped, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading id of a Markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in _outside_fences(path.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = github_anchor(match.group(1))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links and #anchors of ``path`` that point at nothing."""
    broken = []
    for line in _outside_fences(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{target}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{target}: no heading #{anchor} in {dest}")
    return broken


def test_github_anchor_follows_githubs_rules():
    assert github_anchor("Prefill/decode disaggregation") == "prefilldecode-disaggregation"
    assert github_anchor("Replicas on Ray Serve (`bench replicas`)") == (
        "replicas-on-ray-serve-bench-replicas"
    )
    assert github_anchor("The README's runs, 2026-12-04") == "the-readmes-runs-2026-12-04"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Part two\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#part-two) [gone](c.md) [bad](a.md#part-three) [self](#b)\n# B\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["c.md", "a.md#part-three"]


def test_readme_links_and_anchors_resolve():
    assert broken_links(README) == []


def test_readme_stays_a_guide():
    assert len(README.read_text().splitlines()) <= 400


def test_structures_names_only_modules_that_exist():
    text = (ROOT / "docs" / "structures.md").read_text()
    named = re.findall(r"`(pagedattn/[\w/]+\.py)`", text)
    assert len(named) > 50
    assert [p for p in named if not (ROOT / p).is_file()] == []


def _subcommand_options() -> dict[str, set[str]]:
    from pagedattn.cli import build_parser

    (subparsers,) = [
        a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"
    ]
    return {name: set(p._option_string_actions) for name, p in subparsers.choices.items()}


def _commands(text: str) -> list[str]:
    """The shell commands of a Markdown file's code blocks, continuation lines joined."""
    joined = "\n".join(_fenced(text)).replace("\\\n", " ")
    return [line.split(" # ")[0] for line in joined.splitlines()]


# The benchmark history keeps its commands as they were run; every other page is current.
CURRENT_PAGES = ["README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md"
)


@pytest.mark.parametrize("page", CURRENT_PAGES)
def test_every_flag_of_a_pagedattn_command_exists(page):
    options = _subcommand_options()
    unknown = []
    for command in _commands((ROOT / page).read_text()):
        match = re.search(r"pagedattn (generate|chat|serve|env)\b(.*)", command)
        if not match:
            continue
        name, rest = match.groups()
        flags = re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", rest)
        unknown += [f"{name} {flag}" for flag in flags if flag not in options[name]]
    assert unknown == []


def test_every_flag_the_readme_names_exists():
    options = set().union(*_subcommand_options().values())
    text = "\n".join(line for line in README.read_text().splitlines() if "bench" not in line)
    named = set(re.findall(r"`(--[a-z][\w-]*)", text))
    assert named and sorted(named - options) == []


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([\w-]+)", README.read_text()))
    named |= set(re.findall(r"^make ([\w-]+)", "\n".join(_fenced(README.read_text())), re.M))
    assert {"demo", "test"} <= named
    assert sorted(named - targets) == []
