"""The dashboard's heartbeat: the last steps and the latest engine figures, as JSON-ready data."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from roofline.metrics.heartbeat import Heartbeat
from roofline.metrics.stats import IterationStats
from roofline.metrics.step_roofline import StepRoofline
from tests.metrics.test_prometheus import Snap


def _rec(t, step, memory, compute, pre, dec, nbytes=4e9, flops=2e12):
    return StepRoofline(t, step, max(memory, compute), memory, compute, nbytes * 0.75, nbytes * 0.25, flops, pre,
                        dec, max(dec, 1), 0.5)


def test_heartbeat_keeps_the_last_steps_and_derives_the_device():
    hb = Heartbeat(max_steps=3, window=2)
    assert hb.snapshot()["steps"] == [] and hb.snapshot()["updated"] is None
    hb.record(IterationStats(timestamp=1.0, engine=replace(Snap(), step_roofline=[
        _rec(1.0, 0.02, 0.002, 0.001, 0, 8), _rec(2.0, 0.5, 0.002, 0.1, 512, 0)])))
    hb.record(IterationStats(timestamp=2.0, engine=replace(Snap(), num_running=5, step_roofline=[
        _rec(3.0, 0.03, 0.002, 0.001, 0, 8), _rec(4.0, 0.04, 0.002, 0.001, 0, 8)])))
    hb.record(IterationStats(timestamp=3.0, engine=None))  # no snapshot: nothing changes
    s = json.loads(json.dumps(hb.snapshot()))
    assert [x["t"] for x in s["steps"]] == [2.0, 3.0, 4.0]  # the last 3
    first = s["steps"][0]
    assert first["phase"] == "prefill" and first["roof"] == "compute" and first["ratio"] == pytest.approx(5.0)
    assert first["step_ms"] == pytest.approx(500) and first["bound_ms"] == pytest.approx(100)
    assert s["engine"]["num_running"] == 5 and s["engine"]["kv_cache_usage"] == 0.25
    assert s["roofline"]["totals"]["steps"] == 4
    assert s["roofline"]["totals"]["step_seconds"] == pytest.approx(0.59)
    assert s["roofline"]["window_median_ratio"]["decode"] == pytest.approx(17.5)  # median(15, 20), window 2
    assert s["device"]["bandwidth_bytes_per_s"] == pytest.approx(4e9 / 0.002)
    assert s["device"]["peak_flops"] == pytest.approx(2e12 / 0.001)


def test_heartbeat_steps_carry_the_schedulers_plan():
    hb = Heartbeat()
    planned = StepRoofline(1.0, 0.02, 0.01, 0.01, 0.001, 3e9, 1e9, 1e12, 64, 8, 9, 0.5, 0.018, 72, 0.03, 2)
    hb.record(IterationStats(timestamp=1.0, engine=replace(Snap(), step_roofline=[planned, _rec(2.0, 0.02, 0.002,
                                                                                                  0.001, 0, 8)])))
    s = json.loads(json.dumps(hb.snapshot()))
    first, second = s["steps"]
    assert first["predicted_ms"] == pytest.approx(18) and first["token_budget"] == 72
    assert first["target_ms"] == pytest.approx(30) and first["draft_length"] == 2
    assert second["predicted_ms"] is None and second["token_budget"] is None and second["target_ms"] is None
    assert second["draft_length"] is None
