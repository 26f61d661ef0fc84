"""Properties of the EPLB placement (hypothesis): every logical expert has a replica, every rank holds
the same number of physical experts, the heaviest rank stays within the greedy bound (its node's mean +
the heaviest single replica there), hot experts get the redundant slots; plus a skewed example that the
rebalance lifts from poor to good balance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roofline.eplb.algorithm import (
    balanced_packing,
    balancedness,
    initial_placement,
    rebalance,
    replicate,
)


@st.composite
def problems(draw):
    num_ranks = draw(st.sampled_from([1, 2, 4, 8]))
    num_nodes = draw(st.sampled_from([n for n in (1, 2, 4) if num_ranks % n == 0]))
    num_groups = draw(st.sampled_from([1, 2, 4, 8]))
    per_group = draw(st.integers(1, 4))
    num_logical = num_groups * per_group
    extra = draw(st.integers(0, 2 * num_ranks))
    num_redundant = (-num_logical) % num_ranks + extra - extra % num_ranks
    loads = draw(st.lists(st.integers(0, 1000), min_size=num_logical, max_size=num_logical))
    return loads, num_ranks, num_redundant, num_groups, num_nodes


@settings(max_examples=300, deadline=None)
@given(problems())
def test_placement_properties(problem):
    loads, num_ranks, num_redundant, num_groups, num_nodes = problem
    p = rebalance(loads, num_ranks, num_redundant, num_groups, num_nodes)
    assert p.num_physical == len(loads) + num_redundant
    assert set(p.physical_to_logical) == set(range(len(loads)))  # every logical expert has a replica
    assert all(len(p.rank_slots(r)) == p.per_rank for r in range(num_ranks))  # equal slots per rank
    assert sum(len(p.rank_slots(r)) for r in range(num_ranks)) == p.num_physical
    rank_loads = p.rank_loads(loads)
    assert sum(rank_loads) == pytest.approx(sum(loads))
    # greedy bound, per node (the hierarchy keeps a group's experts on one node): no rank above its node's
    # mean by more than the heaviest physical expert's share there; with one node, the world's mean
    shares = [loads[e] / len(p.replicas(e)) for e in p.physical_to_logical]
    per_node = num_ranks // num_nodes
    for node in range(num_nodes):
        ranks = range(node * per_node, (node + 1) * per_node)
        node_loads = [rank_loads[r] for r in ranks]
        node_shares = [shares[q] for r in ranks for q in range(r * p.per_rank, (r + 1) * p.per_rank)]
        assert max(node_loads) <= sum(node_loads) / per_node + max(node_shares) + 1e-6
    if num_nodes == 1:
        assert max(rank_loads) <= sum(rank_loads) / num_ranks + max(shares) + 1e-6
    assert 0.0 < balancedness(rank_loads) <= 1.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e4), min_size=1, max_size=12), st.integers(0, 12))
def test_replicas_go_to_the_hottest(loads, extra):
    count = replicate(loads, len(loads) + extra)
    assert sum(count) == len(loads) + extra and min(count) >= 1
    # no move of one replica lowers the highest load per replica (the greedy is optimal here)
    peak = max(l / c for l, c in zip(loads, count))
    for e, c in enumerate(count):
        if c > 1:
            assert loads[e] / (c - 1) >= peak - 1e-9 * max(1.0, peak)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.data())
def test_balanced_packing_has_equal_counts(num_packs, per_pack, data):
    weights = data.draw(st.lists(st.floats(0, 100), min_size=num_packs * per_pack, max_size=num_packs * per_pack))
    packs = balanced_packing(weights, num_packs)
    assert sorted(packs.count(p) for p in range(num_packs)) == [per_pack] * num_packs
    loads = [sum(w for w, p in zip(weights, packs) if p == q) for q in range(num_packs)]
    assert max(loads) <= sum(weights) / num_packs + max(weights) + 1e-6


def test_skewed_router_goes_from_poor_to_good_balance():
    loads = [400, 300, 200, 100] + [10] * 12  # four hot experts
    before = initial_placement(16, 4)
    assert balancedness(before.rank_loads(loads)) <= 0.5
    after = rebalance(loads, 4, num_redundant=4)
    assert balancedness(after.rank_loads(loads)) >= 0.9
    assert len(after.replicas(0)) >= 2 and len(after.replicas(15)) == 1


def test_bad_shapes_name_the_numbers():
    with pytest.raises(ValueError, match="10 experts \\+ 1 redundant do not split evenly over 4"):
        rebalance([1] * 10, 4, 1)
    with pytest.raises(ValueError, match="do not split evenly"):
        initial_placement(6, 4)
    assert initial_placement(8, 4).physical_to_logical == tuple(range(8))


def test_replicas_are_counted_to_fit_the_ranks():
    """Two hot experts, four ranks, four redundant slots: the greedy alone gives each hot expert three
    replicas, which spread 2, 2, 1, 1 (0.75); two replicas each spread evenly (1.0)."""
    loads = [512, 512] + [0] * 14
    greedy = replicate(loads, 20)
    assert greedy[:2] == [3, 3]
    p = rebalance(loads, 4, num_redundant=4)
    assert balancedness(p.rank_loads(loads)) == pytest.approx(1.0)
    assert [len(p.replicas(e)) for e in (0, 1)] == [2, 2]  # the leftover slots replicate cold experts


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.integers(0, 3), st.data())
def test_never_worse_than_the_plain_greedy(num_ranks, rounds, data):
    num_logical = num_ranks * data.draw(st.integers(1, 3))
    num_redundant = num_ranks * rounds
    loads = data.draw(st.lists(st.integers(0, 1000), min_size=num_logical, max_size=num_logical))
    count = replicate(loads, num_logical + num_redundant)
    replicas = [e for e, c in enumerate(count) for _ in range(c)]
    shares = [loads[e] / count[e] for e in replicas]
    packs = balanced_packing(shares, num_ranks)
    greedy_peak = max(sum(s for s, q in zip(shares, packs) if q == r) for r in range(num_ranks))
    p = rebalance(loads, num_ranks, num_redundant)
    assert max(p.rank_loads(loads)) <= greedy_peak + 1e-6
