"""The Grafana dashboard JSON: importable structure, and every metric it queries exists in our registry."""

from __future__ import annotations

import json
import os
import re

from roofline.metrics.prometheus import PrometheusStatLogger, TPOT_BUCKETS, TTFT_BUCKETS
from roofline.metrics.stats import FinishedRequestStats, IterationStats
from roofline.metrics.step_roofline import StepRoofline
from tests.metrics.test_prometheus import Snap

import roofline.metrics

DASHBOARD = os.path.join(os.path.dirname(roofline.metrics.__file__), "grafana", "roofline-dashboard.json")


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _exported_sample_names() -> set[str]:
    """Every sample name our registry exports once each kind of observation has happened."""
    snap = Snap()
    snap.step_roofline = [StepRoofline(0.0, 0.02, 0.01, 0.01, 0.001, 1.0, 1.0, 1.0, 0, 2, 2, 0.1),
                          StepRoofline(0.0, 0.5, 0.1, 0.01, 0.1, 1.0, 1.0, 1.0, 64, 0, 1, 0.1)]
    p = PrometheusStatLogger("m")
    p.record(IterationStats(timestamp=1.0, engine=snap, ttfts=[0.1], itls=[0.01],
                            finished=[FinishedRequestStats("length", 1.0, 0.1, 0.1, 10, 5)]))
    return {s.name for fam in p.registry.collect() for s in fam.samples}


def test_dashboard_is_an_importable_grafana_dashboard():
    d = _dashboard()
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list), ("templating", dict),
                      ("time", dict), ("__inputs", list)):
        assert isinstance(d.get(key), kind), key
    assert d["__inputs"][0]["pluginId"] == "prometheus" and d["__inputs"][0]["type"] == "datasource"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
    cells = set()
    for p in d["panels"]:
        assert p["type"] == "timeseries" and p["title"] and p["datasource"]["type"] == "prometheus"
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= set(g) and g["x"] + g["w"] <= 24
        cell = (g["x"], g["y"])
        assert cell not in cells, f"panels overlap at {cell}"
        cells.add(cell)
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs))
        assert all(t["expr"] and t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for topic in ("time to first token", "time per output token", "inter-token", "goodput", "queue", "kv cache",
                  "prefix cache", "preemptions", "bound"):
        assert topic in titles, topic
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"model", "ttft_slo", "tpot_slo"} <= names


def test_every_queried_metric_exists_in_our_registry():
    exported = _exported_sample_names()
    queried = set()
    for p in _dashboard()["panels"]:
        for t in p["targets"]:
            queried |= set(re.findall(r"roofline:[a-z_]+", t["expr"]))
    assert queried, "no metric queried"
    missing = sorted(queried - exported)
    assert not missing, f"dashboard queries metrics the server does not export: {missing}"
    for needed in ("roofline:step_roofline_ratio", "roofline:step_ratio_bucket", "roofline:step_time_seconds_sum",
                   "roofline:step_bound_seconds_sum", "roofline:step_bytes_read_total", "roofline:step_flops_total"):
        assert needed in queried, needed


def test_slo_choices_are_histogram_buckets():
    """Goodput panels read `le="$slo"` buckets: every choice must be a bucket bound as Prometheus prints it."""
    variables = {v["name"]: v for v in _dashboard()["templating"]["list"]}
    for name, buckets in (("ttft_slo", TTFT_BUCKETS), ("tpot_slo", TPOT_BUCKETS)):
        printed = {repr(float(b)) for b in buckets}
        for option in variables[name]["options"]:
            assert option["value"] in printed, (name, option["value"])
