"""The per-step token budget (core/step_budget.py): prefill tokens join the decodes while the predicted step time
stays within the target; never above max_num_batched_tokens; the oldest prompt advances every step; the budget
follows the measured step times.  No model: a fake step-time estimate or the real one over a fake cost model,
measured by a fake clock."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.request import Request, RequestStatus
from roofline.core.scheduler import Scheduler
from roofline.core.step_budget import DEFAULT_ITL_FACTOR, MIN_CHUNK_TOKENS, StepBudget
from roofline.core.step_time import StepTimeModel
from roofline.sampling_params import SamplingParams
from tests.core.test_scheduler_properties import VOCAB, SimDevice, next_token, request_specs, run


class LinearCost:
    """A fake cost model: a step's bound is fixed + per token + per KV byte (a decode reads its context)."""

    def __init__(self, fixed=0.010, per_token=0.0001, per_position=1e-6):
        self.fixed, self.per_token, self.per_position = fixed, per_token, per_position

    def request_cost(self, start, n, phase):
        return float(start + n) if phase == "decode" else 0.0, 0.0

    def bound(self, n_tokens, kv_bytes, attn_flops):
        return self.fixed + self.per_token * n_tokens + self.per_position * kv_bytes


class FakeStepTime:
    """A fake estimate: decodes cost per_decode each, prefill tokens per_prefill each, times `slowdown`."""

    def __init__(self, base=0.010, per_decode=0.0002, per_prefill=0.0001):
        self.base, self.per_decode, self.per_prefill, self.slowdown = base, per_decode, per_prefill, 1.0
        self.margin = 1.0

    def tail_margin(self):
        return self.margin

    def predictor(self, decodes):
        d = sum(n for _, n in decodes)
        return lambda chunks: self.slowdown * (self.base + self.per_decode * d
                                               + self.per_prefill * sum(n for _, n in chunks))


class FakeClock:
    """The engine's clock as the step-time estimate sees it: each step 'takes' its bound times `factor`."""

    def __init__(self, cost):
        self.cost, self.factor, self.now = cost, 1.0, 0.0

    def run_step(self, out, model: StepTimeModel) -> None:
        items = [(s.num_computed_tokens, len(s.token_ids), s.num_draft_tokens) for s in out.scheduled]
        kv = sum(self.cost.request_cost(start, n, "decode" if n - d == 1 else "prefill")[0] for start, n, d in items)
        n = sum(c for _, c, _ in items)
        bound = self.cost.bound(n, kv, 0.0)
        seconds = bound * self.factor
        self.now += seconds
        model.observe(n, seconds, bound)


def _req(rid, prompt_len, max_tokens=64, arrival=0.0):
    return Request(rid, [1 + (i % (VOCAB - 1)) for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens,
                   ignore_eos=True), eos_token_id=None, arrival_time=arrival)


def _sched(budget, cap=512, max_seqs=16, block_size=16, num_blocks=1024):
    sc = SchedulerConfig(max_num_batched_tokens=cap, max_num_seqs=max_seqs, max_model_len=100_000)
    return Scheduler(sc, CacheConfig(block_size=block_size, enable_prefix_caching=False), num_blocks,
                     step_budget=budget)


def _step(sched, dev, out):
    sched.update_from_output(out, dev.execute(sched, out))


def _decoding(sched, dev, n, prompt_len=8):
    """n requests past their prompts, decoding."""
    for i in range(n):
        sched.add_request(_req(f"d{i}", prompt_len, max_tokens=1000))
    _step(sched, dev, sched.schedule())
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in sched.running)


# ---- the plan alone ---------------------------------------------------------------------------
def test_no_decodes_means_the_cap():
    plan = StepBudget(FakeStepTime(), target_s=0.001).plan([], [(0, 5000)], cap=2048)
    assert (plan.budget, plan.prefill_tokens, plan.target_s) == (2048, 2048, 0.0)


def test_explicit_target_takes_every_token_of_slack():
    est = FakeStepTime(base=0.25, per_decode=0.0, per_prefill=2**-10)  # dyadic: exact arithmetic
    plan = StepBudget(est, target_s=0.5).plan([(100, 1)] * 8, [(0, 5000)], cap=2048)
    assert plan.prefill_tokens == 256 and plan.budget == 264 and plan.target_s == 0.5
    assert est.predictor([(100, 1)] * 8)([(0, plan.prefill_tokens + 1)]) > 0.5
    # the cap stays hard, and no more than there is to prefill
    assert StepBudget(est, target_s=10.0).plan([(100, 1)] * 8, [(0, 5000)], cap=2048).budget == 2048
    assert StepBudget(est, target_s=10.0).plan([(100, 1)] * 8, [(0, 50), (0, 30)], cap=2048).prefill_tokens == 80


def test_the_tail_margin_shrinks_the_prefill_to_keep_the_slow_steps_within_the_target():
    est = FakeStepTime()
    decodes = [(100, 1)] * 8  # 0.0116 s; each prefill token 0.1 ms
    assert StepBudget(est, target_s=0.02165).plan(decodes, [(0, 5000)], cap=2048).prefill_tokens == 100
    est.margin = 1.25  # a step with prefill runs up to 1.25x its estimate: plan to 0.01732 s
    assert StepBudget(est, target_s=0.02165).plan(decodes, [(0, 5000)], cap=2048).prefill_tokens == 57


def test_a_target_below_the_decodes_alone_still_gives_the_minimum_chunk():
    plan = StepBudget(FakeStepTime(), target_s=1e-6).plan([(100, 1)] * 4, [(0, 5000)], cap=2048)
    assert plan.prefill_tokens == MIN_CHUNK_TOKENS and plan.budget == 4 + MIN_CHUNK_TOKENS
    # decodes and the minimum chunk above the cap: the cap wins
    decodes = [(0, 1)] * (40 - MIN_CHUNK_TOKENS + 3)
    assert StepBudget(FakeStepTime(), target_s=1e-6).plan(decodes, [(0, 500)], cap=40).budget == 40


def test_default_target_is_a_multiple_of_the_decodes_alone():
    est = FakeStepTime(base=0.0, per_decode=2**-10, per_prefill=2**-12)
    plan = StepBudget(est).plan([(100, 1)] * 256, [(0, 5000)], cap=8192)
    decodes_alone = 0.25
    assert plan.target_s == DEFAULT_ITL_FACTOR * decodes_alone
    assert plan.prefill_tokens == (DEFAULT_ITL_FACTOR - 1) * decodes_alone * 4096 == 256
    # a small batch with nothing joining it: the minimum chunk, as far as the cap leaves room beside the decodes
    assert StepBudget(est).plan([(100, 1)], [(0, 5000)], cap=8192).prefill_tokens == MIN_CHUNK_TOKENS
    assert StepBudget(est).plan([(100, 1)] * 50, [(0, 5000)], cap=100).budget == 100


def test_default_target_counts_the_batch_being_built():
    """A burst of prompts meeting few decodes: the default target is a multiple of the decode step of the
    batch they are building (the running decodes and every prompt that joins them), so the burst is admitted
    at the pace the full batch will run at, not one minimum chunk a step."""
    est = FakeStepTime(base=0.0, per_decode=2**-10, per_prefill=2**-12)
    decodes, prompts = [(100, 1)] * 4, [(0, 128)] * 60
    joining = [(128, 1)] * 252  # the 60 prompts in the step's list and the queue behind them: 256 decodes in all
    plan = StepBudget(est).plan(decodes, prompts, cap=8192, joining=joining)
    assert plan.target_s == DEFAULT_ITL_FACTOR * 256 * 2**-10
    # 4 decodes (2**-8 s) + P prefill tokens within 1.25 x 0.25 s: P = (0.3125 - 2**-8) * 4096 = 1264
    assert plan.prefill_tokens == 1264
    # the 4 decodes alone as the reference: 1.25 x 2**-8 s leaves 4 prefill tokens, the minimum chunk
    assert StepBudget(est).plan(decodes, prompts, cap=8192).prefill_tokens == MIN_CHUNK_TOKENS


def test_the_scheduler_passes_the_batch_being_built():
    """The scheduler's `joining`: the step's prompts and the waiting queue behind them, as far as max_num_seqs
    leaves seats -- 2 decodes, 30 prompts of 100 tokens waiting, 16 seats: 14 join (6 of them this step's
    prompts, under the 512-token cap)."""
    est = FakeStepTime(base=0.0, per_decode=2**-10, per_prefill=2**-12)
    sched = _sched(StepBudget(est), cap=512, max_seqs=16)
    dev = SimDevice(1024, 0, 16)
    _decoding(sched, dev, 2)
    for i in range(30):
        sched.add_request(_req(f"p{i}", 100))
    out = sched.schedule()
    assert out.target_step_s == DEFAULT_ITL_FACTOR * (2 + 14) * 2**-10
    # 2 decodes + P tokens within 20 * 2**-10 s: P = 18 * 4 = 72 (above the minimum chunk)
    assert out.token_budget == 2 + 72


def test_budget_follows_the_model_when_steps_get_slower_or_faster():
    est = FakeStepTime(base=0.25, per_decode=0.0, per_prefill=2**-10)
    budget = StepBudget(est, target_s=0.75)
    args = ([(100, 1)] * 8, [(0, 5000)], 2048)
    normal = budget.plan(*args).prefill_tokens
    est.slowdown = 2.0
    slower = budget.plan(*args).prefill_tokens
    est.slowdown = 0.5
    faster = budget.plan(*args).prefill_tokens
    assert (slower, normal, faster) == (128, 512, 1280)


# ---- through the scheduler, calibrated by a fake clock -------------------------------------------
def test_measured_step_times_move_the_budget():
    """The real estimate over a fake cost model: when steps take longer than the bound (the fake clock says so)
    the budget shrinks, when they get faster it grows (past the size a slow spell kept it under)."""
    cost = LinearCost(fixed=0.010, per_token=0.0001, per_position=0.0)
    model = StepTimeModel(cost)
    clock = FakeClock(cost)
    sched = _sched(StepBudget(model, target_s=0.050), cap=4096, max_seqs=64)
    dev = SimDevice(1024, 0, 16)
    _decoding(sched, dev, 8)
    budgets = {}
    for phase, factor in (("normal", 1.0), ("slower", 2.0), ("faster", 0.5)):
        clock.factor = factor
        for k in range(40):  # two prompts queued keep a full chunk in every step; the ratio settles
            while sum(r.request_id.startswith("p") for r in sched.running + sched.waiting) < 2:
                sched.add_request(_req(f"p{phase}{k}{len(sched.waiting)}", 3000, max_tokens=1))
            out = sched.schedule()
            clock.run_step(out, model)
            _step(sched, dev, out)
        budgets[phase] = out.token_budget
        prefill = sum(len(s.token_ids) for s in out.scheduled if s.req_id.startswith("p"))
        assert prefill == out.token_budget - 8  # the chunks are the budget's slack
    # bound(8 + P) = 0.010 + 0.0001 (8 + P); measured f * bound <= 0.050: P = 392, 142, 892
    assert abs(budgets["normal"] - 400) <= 1 and abs(budgets["faster"] - 900) <= 1
    assert abs(budgets["slower"] - 150) <= 2  # the ratio's EMA is within a hair of 2 after 40 steps


def test_decode_steps_and_steps_with_prefill_keep_their_own_ratios():
    """Decodes run at 2x their bound, prefill tokens beside them at 1x theirs.  A step of 16 decodes and 4 prefill
    tokens shares a token bucket with 16 decodes alone, but the model keeps the two apart: the decode-only ratio
    (the default target's reference) stays what decode-only steps measure however many steps with prefill come
    after, and such a step is predicted as its decodes at their ratio plus its chunk at the chunk's."""
    unit = 2**-10  # dyadic: exact arithmetic
    model = StepTimeModel(LinearCost(fixed=0.0, per_token=unit, per_position=0.0))
    decodes = [(100, 1)] * 16
    for _ in range(5):
        model.observe(16, 2 * 16 * unit)
    for _ in range(60):  # far past STALE_AFTER observations
        model.observe(20, 2 * 16 * unit + 4 * unit, 20 * unit, prefill_tokens=4, decodes=decodes)
    assert model.ratio(17) == 2.0 and model.ratio(4, prefill=True) == 1.0
    assert model.estimate(20, 20 * unit, 4, decodes) == 36 * unit
    predict = model.predictor(decodes)
    assert predict(()) == 32 * unit and predict([(500, 4)]) == 36 * unit
    assert predict([(500, 1)]) == 2 * 17 * unit  # a prompt's last token alone is a decode's row
    plan = StepBudget(model, factor=1.5).plan(decodes, [(500, 1000)], cap=2048)
    # target 1.5 x 32 units: 16 units of slack at 1 unit a prefill token (one ratio of 36/20 for the whole
    # step, as before, gave 8)
    assert plan.target_s == 1.5 * 32 * unit and plan.prefill_tokens == 16


def test_a_kind_of_step_not_yet_seen_borrows_the_other_kinds_ratio():
    model = StepTimeModel(LinearCost(fixed=0.010, per_token=0.0, per_position=0.0))
    assert model.ratio(16) == model.ratio(16, prefill=True) == 1.0
    model.observe(16, 0.030)
    assert model.ratio(64, prefill=True) == 3.0
    model.observe(64, 0.050, prefill_tokens=64)  # no decodes: the chunk is the whole step
    assert model.ratio(64, prefill=True) == 5.0 and model.ratio(16) == 3.0 and model.steps == 2


def test_a_chunk_that_adds_nothing_to_the_bound_teaches_nothing():
    """A memory-bound batch with room for a chunk: the step's bound is its decodes'; what the step took beyond
    them is not a ratio of anything."""
    model = StepTimeModel(lambda n: 0.010)
    model.observe(16, 0.020)
    model.observe(20, 0.050, 0.010, prefill_tokens=4, decodes=[(100, 1)] * 16)
    assert model.tables[True].steps == 0 and model.ratio(4, prefill=True) == 2.0  # borrowed from the decodes'
    assert model.estimate(20, 0.010, 4, [(100, 1)] * 16) == 0.020


def test_decodes_keep_their_tokens_behind_a_long_prompt():
    """A prompt ahead of the decodes in the running list (as a swapped-out decode finds it when it comes back)
    takes only the step's prefill tokens, never the decodes'."""
    sched = _sched(StepBudget(FakeStepTime(), target_s=1e-6), cap=512)
    dev = SimDevice(1024, 0, 16)
    sched.add_request(_req("alone", 600, max_tokens=1))
    out = sched.schedule()  # no decodes: the cap
    assert out.total_num_scheduled_tokens == 512 and out.token_budget == 512 and out.target_step_s == 0.0
    _step(sched, dev, out)
    _step(sched, dev, sched.schedule())
    _decoding(sched, dev, 6)
    sched.add_request(_req("long", 2000, max_tokens=1))
    _step(sched, dev, sched.schedule())  # its first chunk
    sched.running.sort(key=lambda r: r.request_id != "long")
    while "long" in sched.requests:
        left = 2000 - sched.requests["long"].num_computed_tokens
        out = sched.schedule()
        got = {s.req_id: len(s.token_ids) for s in out.scheduled}
        assert all(got[f"d{i}"] == 1 for i in range(6))
        assert got["long"] == min(MIN_CHUNK_TOKENS, left) and out.token_budget == 6 + MIN_CHUNK_TOKENS
        _step(sched, dev, out)


def test_no_budget_is_the_cap_as_before():
    """Without a budget a long prompt ahead of the decodes takes the whole cap, as it always did."""
    sched = _sched(None, cap=64)
    dev = SimDevice(1024, 0, 16)
    _decoding(sched, dev, 3)
    sched.add_request(_req("long", 500, max_tokens=1))
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 64 and out.token_budget == 0 and out.draft_length == -1


def test_waiting_prompts_are_served_oldest_first():
    sched = _sched(StepBudget(FakeStepTime(), target_s=1e-6), cap=512)
    dev = SimDevice(1024, 0, 16)
    _decoding(sched, dev, 2)
    for i in range(3):
        sched.add_request(_req(f"p{i}", 40, max_tokens=1, arrival=1.0 + i))
    order = []
    for _ in range(3 * 40 // MIN_CHUNK_TOKENS + 3):
        out = sched.schedule()
        order += [s.req_id for s in out.scheduled if s.req_id.startswith("p") and s.req_id not in order]
        prefill = [s for s in out.scheduled if s.req_id.startswith("p")]
        assert sum(len(s.token_ids) for s in prefill) <= MIN_CHUNK_TOKENS
        _step(sched, dev, out)
    assert order == ["p0", "p1", "p2"]


# ---- property: never above the cap, no starvation -------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 12), st.integers(0, 30), st.integers(1, 2)),
                   min_size=1, max_size=10),
    max_seqs=st.integers(1, 6),
    extra_cap=st.integers(0, 300),
    block_size=st.sampled_from([1, 4, 16, 64]),
    target_ms=st.one_of(st.none(), st.floats(0.001, 100.0)),
    cost=st.tuples(st.floats(0.0, 0.05), st.floats(0.0, 0.001), st.floats(0.0, 1e-4)),
    factors=st.lists(st.floats(0.2, 5.0), min_size=1, max_size=8),
)
def test_budget_never_exceeds_the_cap_and_every_prompt_advances(specs, max_seqs, extra_cap, block_size, target_ms,
                                                                 cost, factors):
    """Random arrivals (prompt length, max_tokens, arrival step, n), step costs and measured times: every step
    holds at most max_num_batched_tokens (the budget too), every running decode gets its token, the oldest prompt
    in prefill gets at least the minimum chunk (or what it has left), so every request finishes within a bound."""
    model = StepTimeModel(LinearCost(*cost))
    budget = StepBudget(model, target_ms / 1e3 if target_ms is not None else None)
    # room for every decode and the minimum chunk (else the cap, not the budget, decides who waits)
    cap = max_seqs + budget.min_chunk + extra_cap
    longest = max(p + m for p, m, _, _ in specs)
    num_blocks = max(2 * len(specs) * (-(-longest // block_size) + 1), 8)  # no preemption
    sched = _sched(budget, cap=cap, max_seqs=max_seqs, block_size=block_size, num_blocks=num_blocks)
    dev = SimDevice(num_blocks, 0, block_size)
    clock = FakeClock(model.cost)
    pending = sorted(enumerate(specs), key=lambda x: x[1][2])
    reqs = []
    bound = max(a for _, _, a, _ in specs) + sum(n * (-(-p // budget.min_chunk) + m) for p, m, _, n in specs) + 2
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (plen, max_tokens, _, n) = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
            group = [Request(f"r{i}#{k}", [(i * 7 + j) % VOCAB for j in range(plen)], params, eos_token_id=None,
                             arrival_time=float(step), group_id=f"r{i}", index=k) for k in range(n)]
            for child in group[1:]:
                child.status = RequestStatus.WAITING_FOR_FORK
            group[0].forks_pending = group[1:]
            reqs += group
            for r in group:
                sched.add_request(r)
        left = {r.request_id: r.num_tokens - r.num_computed_tokens for r in sched.running}
        in_prefill = [r for r in sched.running if left[r.request_id] > 1]
        oldest = in_prefill[0] if in_prefill else (
            sched.waiting[0] if sched.waiting and len(sched.running) < max_seqs else None)
        oldest_left = oldest.num_tokens - oldest.num_computed_tokens if oldest is not None else 0
        out = sched.schedule()
        got = {s.req_id: len(s.token_ids) for s in out.scheduled}
        assert out.total_num_scheduled_tokens <= cap and out.token_budget <= cap
        assert all(got.get(rid) == 1 for rid, n in left.items() if n == 1), "a decode lost its token"
        if oldest is not None:
            assert got.get(oldest.request_id, 0) >= min(oldest_left, budget.min_chunk), "the oldest prompt starved"
        clock.factor = factors[step % len(factors)]
        clock.run_step(out, model)
        _step(sched, dev, out)
        step += 1
        assert step <= bound, "no progress"
    for r in reqs:
        assert r.is_finished and r.num_output_tokens == r.sampling_params.max_tokens
        expected = list(r.prompt_token_ids)
        for _ in range(r.sampling_params.max_tokens):
            expected.append(next_token(expected, r.index))
        assert r.all_token_ids == expected
    assert sched.kv.pool.num_free_blocks == num_blocks


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=request_specs(True), block_size=st.sampled_from([1, 4, 16]), cap=st.integers(4, 64),
       max_seqs=st.integers(1, 6), caching=st.booleans(), mode=st.sampled_from(["recompute", "swap"]),
       policy=st.sampled_from(["fcfs", "priority"]), depth=st.integers(1, 3),
       target_ms=st.one_of(st.none(), st.floats(0.001, 50.0)), data=st.data())
def test_scheduler_invariants_hold_under_the_budget(specs, block_size, cap, max_seqs, caching, mode, policy, depth,
                                                    target_ms, data):
    """The scheduler's own properties (test_scheduler_properties.run: KV content, refcounts, the cap, no request in
    two steps in flight, every output equal to the reference) with the budget on: prefix hits, preemption (a
    tight pool), swapping, priority order, n > 1, batches in flight."""
    longest = max(len(p) + m for p, m, *_ in specs)
    min_blocks = -(-longest // block_size) + 2
    low = min_blocks if depth == 1 else 2 * min_blocks  # preemption with one batch at a time
    num_blocks = data.draw(st.integers(low, min_blocks * 4))
    budget = StepBudget(FakeStepTime(), target_ms / 1e3 if target_ms is not None else None)
    run(specs, block_size, num_blocks, cap, max_seqs, caching, mode, policy, depth=depth, step_budget=budget)
