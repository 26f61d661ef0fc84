"""Property tests (hypothesis) of the block pool, KV manager and scheduler, with no model.

A simulated device executes each SchedulerOutput on a "KV store" that records which token sits in
each physical slot (copies and swaps included).  Each step checks that every scheduled request's
block table holds exactly its own tokens at positions 0..S-1 (so prefix hits, copy-on-write and
swapping are right), and the invariants: refcounts never negative, no block both free and in use,
budgets never exceeded.  At the end every request has finished, its output equals an
unconstrained reference run, and every block is back in the pool.  With batches in flight (depth > 1,
as under pipeline parallelism) steps are scheduled before the earlier ones return: no request is in
two steps at once (so no token is scheduled twice), and the same invariants hold.
"""

from __future__ import annotations

import random
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.request import Request, RequestStatus
from roofline.core.scheduler import Scheduler
from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from roofline.sampling_params import SamplingParams

VOCAB = 50


def next_token(tokens: list[int], salt: int = 0) -> int:
    """A deterministic 'model': the next token depends on the whole sequence (and the sibling index,
    so the n completions of one request diverge)."""
    return ((sum((i + 1) * t for i, t in enumerate(tokens)) + 7 * salt) * 2654435761) % VOCAB


class SimDevice:
    def __init__(self, num_blocks: int, num_swap: int, block_size: int) -> None:
        self.bs = block_size
        self.kv = [[None] * block_size for _ in range(num_blocks)]
        self.swap = [[None] * block_size for _ in range(num_swap)]

    def execute(self, sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        for d, c in out.blocks_to_swap_out:
            self.swap[c] = list(self.kv[d])
        for c, d in out.blocks_to_swap_in:
            self.kv[d] = list(self.swap[c])
        for s, d in out.blocks_to_copy:
            self.kv[d] = list(self.kv[s])
        ids, toks = [], []
        for item in out.scheduled:
            req = sched.requests[item.req_id]
            start = item.num_computed_tokens
            assert item.token_ids == req.all_token_ids[start : start + len(item.token_ids)]
            for j, t in enumerate(item.token_ids):
                pos = start + j
                self.kv[item.block_ids[pos // self.bs]][pos % self.bs] = t
        for item in out.scheduled:
            # attention reads positions 0..S-1 through the block table: they must hold this request's tokens
            req = sched.requests[item.req_id]
            end = item.num_computed_tokens + len(item.token_ids)
            seen = [self.kv[item.block_ids[p // self.bs]][p % self.bs] for p in range(end)]
            assert seen == req.all_token_ids[:end], f"KV content wrong for {item.req_id}"
            if item.sample:
                ids.append(item.req_id)
                toks.append([next_token(req.all_token_ids, req.index)])
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, logprobs=[None] * len(ids), prompt_logprobs={})


def check_pool_invariants(sched: Scheduler) -> None:
    pool = sched.kv.pool
    free = set(pool.free_queue)
    assert len(free) == len(pool.free_queue)
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b.ref_cnt == 0) == (b.block_id in free), b
    held: dict[int, int] = {}
    for blocks in sched.kv.req_blocks.values():
        for b in blocks:
            held[b.block_id] = held.get(b.block_id, 0) + 1
    for bid, n in held.items():
        assert pool.blocks[bid].ref_cnt == n, (bid, n, pool.blocks[bid])
    for h, b in pool.cached.items():
        assert b.block_hash == h


def run(requests_spec, block_size, num_blocks, budget, max_seqs, caching, mode, policy="fcfs", abort_at=None,
        depth=1, device_cls=SimDevice, **scheduler_kwargs):
    """depth: steps in flight at once (each executes on submission, as a pipeline's first stage does,
    and its output comes back `depth` steps later)."""
    sc = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=10_000,
                         policy=policy, preemption_mode=mode)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    num_swap = num_blocks * 2 if mode == "swap" else 0
    sched = Scheduler(sc, cc, num_blocks, num_swap, **scheduler_kwargs)
    dev = device_cls(num_blocks, num_swap, block_size)
    reqs = []
    pending = list(enumerate(requests_spec))
    in_flight: deque = deque()
    step = 0
    while pending or sched.has_unfinished_requests() or in_flight:
        # requests arrive over time
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _arrival, prio, n) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
            group = [Request(f"r{i}#{k}", prompt, params, eos_token_id=None, arrival_time=float(i), priority=prio,
                             group_id=f"r{i}", index=k) for k in range(n)]
            for child in group[1:]:
                child.status = RequestStatus.WAITING_FOR_FORK
            group[0].forks_pending = group[1:]
            reqs.extend(group)
            for r in group:
                sched.add_request(r)
        # with steps in flight each takes its share of the requests, as EngineCore asks
        share = -(-(len(sched.running) + len(sched.waiting) + len(sched.swapped)) // depth)
        out = sched.schedule(None if depth == 1 else max(share, 1))
        assert out.total_num_scheduled_tokens <= budget
        assert len(sched.running) <= max_seqs
        busy = {item.req_id for o, _ in in_flight for item in o.scheduled}
        assert not busy & {item.req_id for item in out.scheduled}, "a request scheduled while in flight"
        check_pool_invariants(sched)
        if depth == 1 or out.scheduled or out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:
            in_flight.append((out, dev.execute(sched, out)))
        while in_flight and (len(in_flight) >= depth or not out.scheduled):
            sched.update_from_output(*in_flight.popleft())
            if not out.scheduled:
                break  # one step back, then schedule again
        check_pool_invariants(sched)
        if abort_at is not None and step == abort_at and reqs:
            sched.finish_requests([reqs[0].request_id], RequestStatus.FINISHED_ABORTED)
        step += 1
        assert step < 5000, "no progress"
    assert sched.kv.pool.num_free_blocks == num_blocks
    assert sched.kv.swap_pool.num_free_blocks == num_swap
    assert not sched.kv.req_blocks
    for r in reqs:
        assert r.is_finished
        if r.status != RequestStatus.FINISHED_ABORTED:
            assert r.num_output_tokens == r.sampling_params.max_tokens
            expected = list(r.prompt_token_ids)
            for _ in range(r.sampling_params.max_tokens):
                expected.append(next_token(expected, r.index))
            assert r.all_token_ids == expected
    return sched


def request_specs(draw_shared_prefix: bool):
    prefix = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40)
    one = st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=50),
        st.integers(1, 12),  # max_tokens
        st.integers(0, 6),  # arrival step
        st.integers(0, 3),  # priority
        st.integers(1, 3),  # n
    )
    return st.tuples(prefix, st.lists(one, min_size=1, max_size=8)).map(
        lambda t: sorted([((t[0] + p) if draw_shared_prefix else p, m, a, pr, n) for p, m, a, pr, n in t[1]],
                         key=lambda x: x[2])
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=request_specs(True),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(4, 64),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    data=st.data(),
)
def test_scheduler_invariants(specs, block_size, budget, max_seqs, caching, mode, policy, data):
    longest = max(len(p) + m for p, m, *_ in specs)
    min_blocks = -(-longest // block_size) + 2  # room for a copy-on-write copy
    num_blocks = data.draw(st.integers(min_blocks, min_blocks * 4))
    run(specs, block_size, num_blocks, budget, max_seqs, caching, mode, policy)


@settings(max_examples=25, deadline=None)
@given(specs=request_specs(True), abort_at=st.integers(0, 10))
def test_abort_returns_blocks(specs, abort_at):
    longest = max(len(p) + m for p, m, *_ in specs)
    run(specs, 4, -(-longest // 4) + 2, 32, 4, True, "recompute", abort_at=abort_at)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=request_specs(True), block_size=st.sampled_from([1, 4, 16]), budget=st.integers(4, 64),
       max_seqs=st.integers(1, 6), caching=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
       depth=st.integers(2, 4), abort_at=st.one_of(st.none(), st.integers(0, 10)), data=st.data())
def test_batches_in_flight(specs, block_size, budget, max_seqs, caching, mode, depth, abort_at, data):
    longest = max(len(p) + m for p, m, *_ in specs)
    min_blocks = -(-longest // block_size) + 2
    num_blocks = data.draw(st.integers(min_blocks, min_blocks * 4))
    sched = run(specs, block_size, num_blocks, budget, max_seqs, caching, mode, abort_at=abort_at, depth=depth)
    assert not sched.in_flight


def test_in_flight_requests_are_skipped_then_resume():
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=1000)
    sched = Scheduler(sc, CacheConfig(block_size=4), 64)
    for i in range(2):
        sched.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), None, float(i)))
    first = sched.schedule()
    assert [s.req_id for s in first.scheduled] == ["r0", "r1"]
    assert not sched.schedule().scheduled  # both in flight: nothing to schedule, nothing twice
    sched.add_request(Request("r2", [4, 5], SamplingParams(max_tokens=4, ignore_eos=True), None, 2.0))
    second = sched.schedule()
    assert [s.req_id for s in second.scheduled] == ["r2"]  # a newcomer fills the next batch
    sched.update_from_output(first, ModelRunnerOutput(req_ids=["r0", "r1"], sampled_token_ids=[[7], [8]],
                                                      logprobs=[None, None], prompt_logprobs={}))
    third = sched.schedule()
    assert [(s.req_id, s.token_ids) for s in third.scheduled] == [("r0", [7]), ("r1", [8])]
    assert sched.in_flight == {"r2": 1, "r0": 1, "r1": 1}


def test_small_pool_preempts_and_counts():
    rng = random.Random(0)
    specs = [([rng.randrange(VOCAB) for _ in range(30)], 20, 0, 0, 1) for _ in range(6)]
    for mode in ("recompute", "swap"):
        sched = run(specs, 4, 16, 64, 6, True, mode)
        assert sched.num_preemptions > 0


def test_prefix_cache_hits_counted():
    shared = list(range(1, 33))
    specs = [(shared + [40 + i], 2, i * 3, 0, 1) for i in range(4)]
    sched = run(specs, 8, 64, 64, 4, True, "recompute")
    # requests 1..3 each hit the 4 full shared blocks (32 tokens)
    assert sched.kv.prefix_cache_hits == 3 * 32
    assert sched.kv.prefix_cache_queries == 4 * 33


def test_swapped_request_comes_back_when_a_forked_sibling_holds_the_blocks():
    """Found by test_batches_in_flight: nothing running, a swapped request needing more blocks than are
    free, and a forked sibling that never ran still holding its prompt's blocks in the waiting queue.
    The sibling must yield its blocks (it recomputes) or the engine makes no progress."""
    specs = [([0] * 4, 1, 0, 0, 1), ([0] * 12, 1, 0, 0, 1), ([0] * 5, 1, 0, 0, 2)]
    run(specs, block_size=1, num_blocks=15, budget=4, max_seqs=2, caching=False, mode="swap", depth=2)


def test_batches_in_flight_do_not_preempt_each_other_forever():
    """Two forked samples that cannot both fit (13 blocks each, 15 in the pool) with two steps in flight:
    the later one is the victim even while its step is out (the earlier waits a step for it), so the earlier
    finishes.  Before, the earlier preempted itself whenever the later was re-admitted behind it, and the two
    recomputed each other forever (found by hypothesis in test_batches_in_flight)."""
    run([([0, 0, 0], 10, 0, 0, 2)], 1, 15, 4, 2, False, "recompute", depth=2)
