"""merge_metrics: one Prometheus page from several replicas, each sample labelled."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedattn.serve.metrics_merge import merge_metrics


def page(requests: int, usage: float) -> str:
    registry = CollectorRegistry()
    c = Counter("reqs", "requests served", ["model_name"], registry=registry)
    c.labels("m").inc(requests)
    Gauge("usage", "kv usage", registry=registry).set(usage)
    return generate_latest(registry).decode()


def test_merged_page_parses_and_keeps_every_replicas_samples():
    merged = merge_metrics({"r1": page(3, 0.5), "r0": page(7, 0.25)})
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    totals = {
        (s.labels["replica"], s.labels.get("model_name")): s.value
        for s in families["reqs"].samples
        if s.name == "reqs_total"
    }
    assert totals == {("r0", "m"): 7.0, ("r1", "m"): 3.0}
    usage = {s.labels["replica"]: s.value for s in families["usage"].samples}
    assert usage == {"r0": 0.25, "r1": 0.5}
    assert merged.count("# HELP reqs_total") == 1 and merged.count("# TYPE usage gauge") == 1


def test_label_values_are_escaped():
    merged = merge_metrics({'odd"id': page(1, 0.0)})
    (family,) = [f for f in text_string_to_metric_families(merged) if f.name == "usage"]
    assert family.samples[0].labels["replica"] == 'odd"id'
