"""Merge the Prometheus text of several replicas into one page, each sample labelled by replica."""

from __future__ import annotations

import re
from collections.abc import Mapping

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def merge_metrics(pages: Mapping[str, str], label: str = "replica") -> str:
    """One exposition: HELP/TYPE once per metric family, then every replica's samples.

    Each sample gains `label="<replica id>"`; families keep the order they first appear in.
    """
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    order: list[str] = []
    for replica_id, text in sorted(pages.items()):
        family = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    if family not in headers:
                        headers[family] = []
                        samples[family] = []
                        order.append(family)
                    if line not in headers[family]:
                        headers[family].append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, rest = match.groups()
            tag = f'{label}="{_escape(replica_id)}"'
            inner = labels[1:-1].strip().rstrip(",") if labels else ""
            merged = "{" + (f"{tag},{inner}" if inner else tag) + "}"
            key = family if family is not None and name.startswith(family) else name
            if key not in samples:
                headers[key] = []
                samples[key] = []
                order.append(key)
            samples[key].append(f"{name}{merged}{rest}")
    out: list[str] = []
    for family in order:
        out.extend(headers[family])
        out.extend(samples[family])
    return "\n".join(out) + "\n"
