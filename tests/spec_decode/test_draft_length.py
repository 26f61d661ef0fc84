"""The per-step draft length: the full k while the step is bound by reading the weights, none once a large
batch makes it compute bound, shorter drafts when acceptance is poor; measured step times recalibrate."""

from __future__ import annotations

from roofline.core.step_time import StepTimeModel
from roofline.spec_decode.draft_length import DraftLengthPolicy


def roofline(weight_s=0.05, per_token_s=0.005):
    """A memory-bound step of 0.05 s until 10 tokens, then compute bound at 5 ms per token."""
    return lambda n: max(weight_s, per_token_s * n)


def test_single_stream_gets_the_full_k_and_large_batches_none():
    p = DraftLengthPolicy(5, roofline())
    assert p.choose(1, 0) == 5
    assert p.choose(64, 0) == 0
    assert 0 < p.choose(3, 0) < 5


def test_poor_acceptance_shortens_the_drafts():
    p = DraftLengthPolicy(5, roofline())
    for _ in range(200):
        p.observe(5, 0)
    assert p.acceptance < 0.05
    assert p.choose(2, 0) == 0
    q = DraftLengthPolicy(5, roofline())
    for _ in range(200):
        q.observe(5, 5)
    assert q.choose(2, 0) >= 4


def test_no_cost_model_means_always_k():
    assert DraftLengthPolicy(3).choose(500, 4000) == 3


def test_measured_times_recalibrate_the_bound():
    m = StepTimeModel(roofline())
    assert m(20) == 0.1
    m.observe(1, 0.1)  # steps of 1 token take twice the bound
    assert abs(m(1) - 0.1) < 1e-12 and abs(m(20) - 0.2) < 1e-12  # unseen bucket: nearest seen below
    for _ in range(100):
        m.observe(20, 0.1)
    assert abs(m(20) - 0.1) < 1e-6


def test_rarely_proposing_workload_weighs_less():
    p = DraftLengthPolicy(4, roofline())
    p.observe_proposals(100, 1)  # prompt lookup found a match for 1% of the decodes
    for _ in range(50):
        p.observe_proposals(100, 1)
    assert p.proposal_share < 0.05


def test_proposals_are_probed_while_k_is_zero():
    from roofline.spec_decode.draft_length import PROBE_EVERY

    p = DraftLengthPolicy(4, roofline())
    asked = [p.num_to_propose(0) for _ in range(2 * PROBE_EVERY)]
    assert asked.count(4) == 2 and asked.count(0) == 2 * PROBE_EVERY - 2
    assert p.num_to_propose(3) == 3
