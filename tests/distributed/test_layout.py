"""Rank arithmetic of ParallelLayout: world = DP x PP x TP with TP innermost; every kind of group
partitions the world; the EP group spans DP x TP inside one pipeline stage; pipeline neighbours."""

from __future__ import annotations

import itertools

import pytest

from roofline.config import EngineArgs
from roofline.distributed.layout import ParallelLayout

LAYOUTS = [ParallelLayout(tp=t, pp=p, dp=d, expert_parallel=e)
           for t, p, d, e in itertools.product((1, 2, 3), (1, 2), (1, 2, 4), (False, True))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_every_kind_partitions_the_world(layout):
    world = set(range(layout.world_size))
    sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ep": layout.ep}
    for kind, size in sizes.items():
        groups = layout.groups(kind)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world), kind
        assert all(len(g) == size for g in groups), kind
        for g in groups:
            for r in g:
                assert layout.group_of(kind, r) == g


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.describe())
def test_coordinates_round_trip_and_group_membership(layout):
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank_of(c.dp, c.pp, c.tp) == r
        # members of a group differ from r only in the group's own coordinate(s)
        for kind, varying in (("tp", {"tp"}), ("pp", {"pp"}), ("dp", {"dp"})):
            g = layout.group_of(kind, r)
            for other in g:
                oc = layout.coords(other)
                same = {k for k in ("dp", "pp", "tp") if getattr(oc, k) == getattr(c, k)}
                assert {"dp", "pp", "tp"} - varying <= same
            assert g.index(r) == getattr(c, kind)  # group order is the coordinate order
        ep = layout.group_of("ep", r)
        if layout.expert_parallel:
            assert {layout.coords(o).pp for o in ep} == {c.pp}
            assert ep.index(r) == c.dp * layout.tp + c.tp  # dp-major
        else:
            assert ep == [r]


def test_concrete_dp2_pp2_tp2():
    layout = ParallelLayout(tp=2, pp=2, dp=2, expert_parallel=True)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.ep_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.coords(6).__dict__ == {"dp": 1, "pp": 1, "tp": 0}
    assert layout.ep == 4 and layout.world_size == 8


def test_pipeline_neighbours():
    layout = ParallelLayout(tp=2, pp=3, dp=2)
    r = layout.rank_of(dp=1, pp=0, tp=1)
    assert layout.is_first_stage(r) and not layout.is_last_stage(r)
    nxt = layout.next_stage_rank(r)
    assert layout.coords(nxt).__dict__ == {"dp": 1, "pp": 1, "tp": 1}
    last = layout.rank_of(dp=1, pp=2, tp=1)
    assert layout.is_last_stage(last) and layout.next_stage_rank(last) == r and layout.prev_stage_rank(r) == last


def test_bad_layouts_name_the_field():
    with pytest.raises(ValueError, match="data_parallel_size must be positive, got 0"):
        ParallelLayout(dp=0)
    with pytest.raises(ValueError, match="outside the world of 4 ranks"):
        ParallelLayout(tp=2, dp=2).coords(4)
    with pytest.raises(ValueError, match="unknown group kind"):
        ParallelLayout().groups("xp")
    with pytest.raises(ValueError, match="data_parallel_size must be positive, got 0"):
        EngineArgs(data_parallel_size=0).create_engine_config()


def test_from_engine_config():
    pc = EngineArgs(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
                    device="cpu").create_engine_config().parallel_config
    layout = ParallelLayout.from_config(pc)
    assert (layout.tp, layout.pp, layout.dp, layout.ep, layout.world_size) == (2, 1, 2, 4, 4) == \
        (2, 1, 2, 4, pc.world_size)
