"""The multi-token step contract (speculative decoding) in the scheduler and KV manager, with no model:
property tests on the simulated device of test_scheduler_properties.py, whose "model" verifies drafts
greedily.  Every step the block tables must hold exactly each request's own tokens (rejected drafts
never leak into a later read or a prefix-cache hit), budgets hold, and at the end the output equals the
non-speculative reference and every block is back in the pool: with chunked prefill, prefix caching,
preemption in both modes, n > 1, priority scheduling and lookahead slots."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.request import Request
from roofline.core.scheduler import Scheduler
from roofline.core.scheduler_output import ModelRunnerOutput
from roofline.sampling_params import SamplingParams
from roofline.spec_decode.draft_length import DraftLengthPolicy
from roofline.spec_decode.rejection_sampler import greedy_accept
from tests.core.test_scheduler_properties import VOCAB, SimDevice, next_token, request_specs, run


class SpecSimDevice(SimDevice):
    """Feeds known tokens and drafts; the 'model' accepts drafts while they equal next_token, and
    proposes for the next step drafts that are right with probability 1/2 per token."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.rng = random.Random(sum(args))
        self.verified = 0

    def execute(self, sched, out):
        for d, c in out.blocks_to_swap_out:
            self.swap[c] = list(self.kv[d])
        for c, d in out.blocks_to_swap_in:
            self.kv[d] = list(self.swap[c])
        for s, d in out.blocks_to_copy:
            self.kv[d] = list(self.kv[s])
        for item in out.scheduled:
            req = sched.requests[item.req_id]
            start, k = item.num_computed_tokens, item.num_draft_tokens
            known = len(item.token_ids) - k
            assert item.token_ids[:known] == req.all_token_ids[start : start + known]
            assert item.token_ids[known:] == req.spec_token_ids[:k]
            assert k == 0 or (item.sample and known == 1)
            assert len(item.block_ids) * self.bs >= start + len(item.token_ids) + (
                sched.num_lookahead_slots if item.sample else 0)
            for j, t in enumerate(item.token_ids):
                pos = start + j
                self.kv[item.block_ids[pos // self.bs]][pos % self.bs] = t
        ids, toks, drafts = [], [], []
        for item in out.scheduled:
            req = sched.requests[item.req_id]
            end = item.num_computed_tokens + len(item.token_ids)
            seen = [self.kv[item.block_ids[p // self.bs]][p % self.bs] for p in range(end)]
            assert seen == req.all_token_ids + req.spec_token_ids[: item.num_draft_tokens] if item.num_draft_tokens \
                else seen == req.all_token_ids[:end], f"KV content wrong for {item.req_id}"
            if item.sample:
                ctx, k = list(req.all_token_ids), item.num_draft_tokens
                d = item.token_ids[len(item.token_ids) - k :] if k else []
                targets = [next_token(ctx + d[:j], req.index) for j in range(k + 1)]
                emitted = greedy_accept(d, targets)
                self.verified += k
                ids.append(item.req_id)
                toks.append(emitted)
                drafts.append(self._propose(ctx + emitted, req.index, out.num_tokens_to_propose))
        return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks, logprobs=[None] * len(ids), prompt_logprobs={},
                                 draft_token_ids=drafts)

    def _propose(self, ctx, index, k):
        out = []
        for _ in range(self.rng.randint(0, k)):
            right = next_token(ctx + out, index)
            out.append(right if self.rng.random() < 0.5 else (right + 1) % VOCAB)
        return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=request_specs(True),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(4, 64),
    max_seqs=st.integers(1, 6),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
    k=st.integers(1, 5),
    lookahead=st.sampled_from([0, 3]),
    data=st.data(),
)
def test_speculative_steps_keep_invariants(specs, block_size, budget, max_seqs, caching, mode, policy, k, lookahead,
                                           data):
    longest = max(len(p) + m for p, m, *_ in specs)
    min_blocks = -(-(longest + k + lookahead) // block_size) + 2
    num_blocks = data.draw(st.integers(min_blocks, min_blocks * 4))
    run(specs, block_size, num_blocks, budget, max_seqs, caching, mode, policy, device_cls=SpecSimDevice,
        draft_length_policy=DraftLengthPolicy(k), num_lookahead_slots=lookahead)


def test_drafts_are_verified_and_counted():
    rng = random.Random(0)
    specs = [([rng.randrange(VOCAB) for _ in range(20)], 30, 0, 0, 1) for _ in range(3)]
    sched = run(specs, 4, 64, 64, 4, True, "recompute", device_cls=SpecSimDevice,
                draft_length_policy=DraftLengthPolicy(4))
    stats = sched.get_stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[1] >= stats.accepted_per_pos[3]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens


def test_rejected_tail_blocks_return_and_never_cache():
    """A rejected draft spanning two blocks: the block holding only rejected tokens goes back to the pool,
    and nothing past the known tokens is in the prefix cache."""
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1000)
    sched = Scheduler(sc, CacheConfig(block_size=4), 16, draft_length_policy=DraftLengthPolicy(6))
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[4]], [None], {}, draft_token_ids=[[5, 6, 7, 8, 9, 10]]))
    out = sched.schedule()
    (item,) = out.scheduled
    assert item.token_ids == [4, 5, 6, 7, 8, 9, 10] and item.num_draft_tokens == 6
    assert len(item.block_ids) == 3  # positions 0..9
    # two drafts accepted, then the target's own token 11
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[5, 6, 11]], [None], {}))
    assert req.all_token_ids == [1, 2, 3, 4, 5, 6, 11] and req.num_computed_tokens == 6
    assert len(sched.kv.req_blocks["a"]) == 2  # the third block held only rejected drafts
    assert sched.kv.pool.num_free_blocks == 14
    assert req.spec_token_ids == []
    hashed = {b.block_hash for b in sched.kv.req_blocks["a"] if b.block_hash is not None}
    assert len(hashed) == 1  # block 0 ([1, 2, 3, 4]); block 1 is partial ([5, 6, 11] known)


def test_draft_length_limited_by_budget_and_max_tokens():
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1000)
    sched = Scheduler(sc, CacheConfig(block_size=4), 16, draft_length_policy=DraftLengthPolicy(8))
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(["a"], [[4]], [None], {}, draft_token_ids=[[5] * 8]))
    (item,) = sched.schedule().scheduled
    assert item.num_draft_tokens == 2  # 1 output so far, max_tokens 4: at most 3 more, one the target's
