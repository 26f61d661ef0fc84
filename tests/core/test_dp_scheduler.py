"""DataParallelScheduler with no model: where requests go (least loaded, prefix-cache aware, n
completions together), that each DP rank's part of a step indexes its own pool, that results and
aborts reach the right rank, and that every block is back in every pool at the end."""

from __future__ import annotations

import pytest

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.dp_scheduler import DataParallelScheduler
from roofline.core.request import Request, RequestStatus
from roofline.core.scheduler import Scheduler
from roofline.core.scheduler_output import ModelRunnerOutput
from roofline.sampling_params import SamplingParams

BS = 4


def make(dp: int = 2, num_blocks: int = 32) -> DataParallelScheduler:
    sc = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16, max_model_len=128)
    cc = CacheConfig(block_size=BS, enable_prefix_caching=True)
    return DataParallelScheduler([Scheduler(sc, cc, num_blocks) for _ in range(dp)])


def req(rid: str, prompt: list[int], max_tokens: int = 3, n: int = 1, index: int = 0, group: str = None) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n),
                   eos_token_id=None, group_id=group, index=index)


def fake_result(out) -> ModelRunnerOutput:
    """Every request that samples gets token 7."""
    ids = [s.req_id for s in out.scheduled if s.sample]
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids], logprobs=[None] * len(ids),
                             prompt_logprobs={})


def run_to_end(s: DataParallelScheduler, max_steps: int = 100) -> list:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        out = s.schedule()
        outs.append(out)
        s.update_from_output(out, fake_result(out))
    raise AssertionError("did not finish")


def test_new_requests_spread_over_the_least_loaded_ranks():
    s = make(dp=3)
    for i in range(7):
        s.add_request(req(f"r{i}", [10 + i] * 9))
    assert s.requests_assigned == [3, 2, 2]
    assert sorted(s.load(d) for d in range(3)) == [2, 2, 3]
    s.finish_requests(["r0", "r3"], RequestStatus.FINISHED_ABORTED)  # both on rank 0 (turns 0, 3)
    assert s.load(0) == 1
    s.add_request(req("late", [99] * 9))
    assert s.rank_holding("late") == 0  # now the least loaded


def test_a_request_goes_where_its_prefix_is_cached_when_the_loads_are_close():
    s = make(dp=2)
    shared = list(range(1, 13))  # three full blocks
    s.add_request(req("a", shared + [50]))
    s.add_request(req("b", [60] * 13))
    first = {r: s.rank_holding(r) for r in ("a", "b")}
    run_to_end(s)  # a's blocks are now in its rank's prefix cache
    s.add_request(req("c", [61] * 13))  # no hit anywhere: least loaded, in turn
    s.add_request(req("d", shared + [51, 52]))  # loads 1 / 0 or 0 / 1: within the slack, the hit wins
    assert s.rank_holding("d") == first["a"]
    out = s.schedule()
    part = out.data_parallel[first["a"]]
    assert {x.req_id for x in part.scheduled} >= {"d"}
    d_item = next(x for x in part.scheduled if x.req_id == "d")
    assert d_item.num_computed_tokens == 12  # the prefix was a hit on that rank


def test_the_completions_of_one_request_stay_on_one_rank():
    s = make(dp=2)
    s.add_request(req("x", [5] * 6))  # rank 0
    kids = [req(f"g#{i}", [9] * 6, n=3, index=i, group="g") for i in range(3)]
    for k in kids[1:]:
        k.status = RequestStatus.WAITING_FOR_FORK
    kids[0].forks_pending = kids[1:]
    for k in kids:
        s.add_request(k)
    assert {s.rank_holding(k.request_id) for k in kids} == {1}
    assert s.requests_assigned == [1, 1]
    run_to_end(s)
    assert not any(rank.requests for rank in s.ranks) and s.rank_holding("g#0") is None


def test_each_part_indexes_its_own_pool_and_all_blocks_come_back():
    s = make(dp=2, num_blocks=8)
    for i in range(4):
        s.add_request(req(f"r{i}", [20 + i] * 10, max_tokens=4))
    out = s.schedule()
    assert len(out.data_parallel) == 2
    assert [x.req_id for x in out.scheduled] == [x.req_id for p in out.data_parallel for x in p.scheduled]
    for d, part in enumerate(out.data_parallel):
        assert {x.req_id for x in part.scheduled} == set(s.ranks[d].requests)
        blocks = [b for x in part.scheduled for b in x.block_ids]
        assert len(blocks) == len(set(blocks)) and max(blocks) < 8  # rank d's own 8 blocks
    slim = out.for_workers()
    assert slim.scheduled == [] and slim.data_parallel == out.data_parallel
    s.update_from_output(out, fake_result(out))
    run_to_end(s)
    for rank in s.ranks:
        assert rank.kv.pool.num_free_blocks == rank.kv.pool.num_blocks
    st = s.get_stats()
    assert st.num_free_blocks == st.num_total_blocks == 16 and st.num_running == 0
    assert st.data_parallel_running == [0, 0] and st.data_parallel_requests == [2, 2]


def test_restricted_keeps_each_parts_requests():
    s = make(dp=2)
    for i in range(4):
        s.add_request(req(f"r{i}", [30 + i] * 5))
    out = s.schedule()
    sub = out.restricted({"r0", "r1"}, first=True)
    assert {x.req_id for x in sub.scheduled} == {"r0", "r1"}
    for full, part in zip(out.data_parallel, sub.data_parallel):
        assert {x.req_id for x in part.scheduled} == {x.req_id for x in full.scheduled} & {"r0", "r1"}


def test_an_idle_rank_still_gets_a_part():
    s = make(dp=2)
    s.add_request(req("only", [3] * 5))
    out = s.schedule()
    assert len(out.data_parallel) == 2
    assert sum(1 for p in out.data_parallel if not p.scheduled) == 1


def test_duplicate_ids_are_refused():
    s = make(dp=2)
    s.add_request(req("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", [1, 2, 3]))
