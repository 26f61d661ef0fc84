"""`roofline bench eplb` on 2 ranks, scaled down: the skewed router loads one rank (balancedness <= 0.5),
the rebalance spreads the hot experts (measured over the next window: >= 0.9), and the all-to-all bytes
of a decode step under uniform-looking load equal the planner's."""

from __future__ import annotations

import argparse

import pytest

from roofline.benchmarks import eplb_skew


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_skewed_router_is_rebalanced_on_two_ranks(capsys, layout):
    """As one tensor-parallel group, and as data-parallel attention (each rank its own requests)."""
    args = argparse.Namespace(ranks=2, layout=layout, requests=8, prompt_len=8, step_interval=4, redundant=4,
                              skew=[0.08], json=True)
    assert eplb_skew.run(args) == 0
    import json

    (r,) = json.loads(capsys.readouterr().out)
    assert r["rebalances"] >= 2
    assert max(r["balancedness_before"]) <= 0.5
    assert min(r["balancedness_measured_after"]) >= 0.9
    assert r["a2a_bytes_per_step_after"] == pytest.approx(r["planner_a2a_bytes_per_step"], rel=0.25)
