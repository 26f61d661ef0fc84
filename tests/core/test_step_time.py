"""The shared step-time estimate: the live roofline's bound for a step's shape, times the measured ratio."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from roofline.core.step_time import StepTimeModel, TokenBound
from roofline.metrics.step_roofline import StepRooflineModel
from roofline.planner.hardware import get_hardware
from roofline.planner.model_specs import MODEL_PRESETS, ModelSpec


def _roofline_model(name="llama-3-8b", gpu="h100-sxm"):
    return StepRooflineModel(ModelSpec.from_hf_config(MODEL_PRESETS[name], name=name), get_hardware(gpu), "bf16")


def _req(start, n, drafts=0):
    return SimpleNamespace(num_computed_tokens=start, token_ids=list(range(n)), num_draft_tokens=drafts)


@pytest.mark.parametrize("name", ["llama-3-8b", "deepseek-v3"])
def test_prediction_is_the_roofline_bound_of_the_same_step(name):
    """Uncalibrated, the estimate of a step's shape is exactly the bound the live roofline records for it."""
    model = _roofline_model(name, "h200")
    est = StepTimeModel(model)
    decodes = [(100, 1), (2000, 1), (37, 4)]  # the last verifies 3 drafts
    chunks = [(0, 300), (512, 1024)]
    rec = model.account([_req(s, n, n - 1) for s, n in decodes] + [_req(s, n) for s, n in chunks], 0.1)
    assert est.predictor(decodes)(chunks) == pytest.approx(rec.bound_s, rel=1e-12)
    assert est.predictor(decodes)([]) == pytest.approx(model.account([_req(s, n, n - 1) for s, n in decodes],
                                                                     0.1).bound_s, rel=1e-12)
    assert model.bound(1000, 2e9, 3e12) == model.record(1000, 2e9, 3e12, 0, 0, 0, 0.0).bound_s
    assert est.predictor([])([]) == 0.0


def test_measured_ratio_scales_the_prediction():
    model = _roofline_model()
    est = StepTimeModel(model)
    decodes = [(500, 1)] * 32
    predict = est.predictor(decodes)
    before, before_large = predict([(0, 200)]), predict([(0, 3000)])
    rec = model.account([_req(500, 1)] * 32 + [_req(0, 200)], 0.0)
    est.observe(232, 3.0 * rec.bound_s, rec.bound_s, 200, decodes)  # that step took 3x its bound
    assert predict([(0, 200)]) == pytest.approx(3.0 * before)  # no decode-only step yet: the whole step's ratio
    assert predict([(0, 3000)]) == pytest.approx(3.0 * before_large)  # an unseen bucket borrows the ratio below
    assert est.estimate(232, rec.bound_s, 200, decodes) == pytest.approx(3.0 * rec.bound_s)


def test_a_step_with_prefill_is_its_decodes_at_their_ratio_plus_its_chunks_at_theirs():
    model = _roofline_model()
    est = StepTimeModel(model)
    decodes = [(500, 1)] * 32
    alone = model.account([_req(500, 1)] * 32, 0.0).bound_s
    est.observe(32, 2.0 * alone, alone)  # decode-only steps: 2x their bound
    assert est.predictor(decodes)([]) == pytest.approx(2.0 * alone)
    rec = model.account([_req(500, 1)] * 32 + [_req(0, 2000)], 0.0)  # compute-bound: the chunk adds to the bound
    assert rec.bound_s > 2 * alone
    est.observe(2032, 2.0 * alone + 5.0 * (rec.bound_s - alone), rec.bound_s, 2000, decodes)  # the chunk at 5x
    assert est.ratio(32) == 2.0 and est.ratio(2000, prefill=True) == pytest.approx(5.0)
    with_large = model.account([_req(500, 1)] * 32 + [_req(0, 3000)], 0.0).bound_s
    assert est.predictor(decodes)([(0, 3000)]) == pytest.approx(2.0 * alone + 5.0 * (with_large - alone))


def test_costs_are_cached_per_shape():
    calls = []

    class Cost:
        def request_cost(self, start, n, phase):
            calls.append((start, n, phase))
            return float(n), 0.0

        def bound(self, n, kv, attn):
            return kv

    est = StepTimeModel(Cost())
    for _ in range(3):
        assert est.predictor([(10, 1), (11, 1), (10, 1)])([(0, 5)]) == 8.0
    assert sorted(set(calls)) == sorted(calls) and len(calls) == 3  # each shape computed once


def test_token_bound_stands_in_for_the_cost_model():
    est = StepTimeModel(lambda n: 0.01 * n)
    assert isinstance(est.cost, TokenBound)
    assert est(10) == pytest.approx(0.1)
    assert est.predictor([(5, 1)] * 4)([(0, 6)]) == pytest.approx(0.1)
    est.observe(10, 0.2)  # no bound given: the token-count bound
    assert est(10) == pytest.approx(0.2)


def test_a_bucket_not_seen_for_a_while_counts_as_unseen():
    """A ratio measured in a slow spell must not keep a size out of reach forever: once stale, the bucket
    borrows from the fresh ones, and its next measurement starts it over."""
    from roofline.core.step_time import STALE_AFTER

    est = StepTimeModel(lambda n: 1.0)
    est.observe(300, 4.0)  # bucket 9, slow
    for _ in range(STALE_AFTER):
        est.observe(200, 0.5)  # bucket 8
    assert est.ratio(300) == 4.0  # still fresh
    est.observe(200, 0.5)
    assert est.ratio(300) == 0.5  # stale: borrows the nearest fresh bucket below
    est.observe(300, 1.0)
    assert est.ratio(300) == 1.0  # starts over, no EMA with the old 4.0


def test_finished_gives_the_estimate_before_it_observes_the_step():
    """The engine's one call per step: what estimate() said of the step, then the same learning as observe()."""
    model = _roofline_model()
    decodes = [(500, 1)] * 32
    rec = model.account([_req(500, 1)] * 32 + [_req(0, 2000)], 0.0)
    alone = model.account([_req(500, 1)] * 32, 0.0).bound_s
    a, b = StepTimeModel(model), StepTimeModel(model)
    for est in (a, b):
        est.observe(32, 2.0 * alone, alone)
    seconds = 2.0 * alone + 5.0 * (rec.bound_s - alone)
    expected = b.estimate(2032, rec.bound_s, 2000, decodes)
    assert a.finished(2032, seconds, rec.bound_s, 2000, decodes) == expected
    b.observe(2032, seconds, rec.bound_s, 2000, decodes)
    assert a.ratio(2000, prefill=True) == b.ratio(2000, prefill=True) == pytest.approx(5.0)
    assert a.finished(32, 2.0 * alone, alone) == pytest.approx(2.0 * alone) and a.ratio(32) == 2.0


def test_a_chunk_step_faster_than_its_decodes_share_keeps_a_positive_ratio():
    """Noise: the step ran faster than its decodes alone at their ratio.  What is left for the chunk is not a
    ratio near 0 (which would price the next chunks, and a step of prefill alone, at nothing) but MIN_RATIO."""
    from roofline.core.step_time import MIN_RATIO

    model = _roofline_model()
    est = StepTimeModel(model)
    decodes = [(500, 1)] * 32
    alone = model.account([_req(500, 1)] * 32, 0.0).bound_s
    rec = model.account([_req(500, 1)] * 32 + [_req(0, 2000)], 0.0)
    est.observe(32, 2.0 * alone, alone)
    est.observe(2032, 1.5 * alone, rec.bound_s, 2000, decodes)
    assert est.ratio(2000, prefill=True) == MIN_RATIO
    assert est.predictor([])([(0, 2000)]) > 0


def test_the_tail_margin_settles_at_the_upper_quantile_of_the_errors():
    """Measured over expected spread evenly over 0.9-1.3: the 90th percentile is 1.26.  Errors all below 1 leave
    the margin at 1; a long slow spell stops at MAX_MARGIN."""
    from roofline.core.step_time import MAX_MARGIN, TailMargin

    m = TailMargin()
    errors = [0.9 + 0.4 * ((i * 37) % 100) / 100 for i in range(3000)]
    tail = []
    for i, e in enumerate(errors):
        m.observe(e)
        if i >= 1000:
            tail.append(m.value)
    assert 1.22 < sum(tail) / len(tail) < 1.30
    low = TailMargin()
    for _ in range(200):
        low.observe(0.8)
    assert low.value == 1.0
    for _ in range(1000):
        low.observe(3.0)
    assert low.value == MAX_MARGIN


def test_only_steps_with_prefill_move_the_tail_margin():
    model = _roofline_model()
    est = StepTimeModel(model)
    decodes = [(500, 1)] * 32
    alone = model.account([_req(500, 1)] * 32, 0.0).bound_s
    rec = model.account([_req(500, 1)] * 32 + [_req(0, 200)], 0.0)
    for _ in range(20):
        est.finished(32, 3.0 * alone, alone)  # decode steps, far off the estimate at first
    assert est.tail_margin() == 1.0
    est.finished(232, 5.0 * rec.bound_s, rec.bound_s, 200, decodes)  # above its estimate (3x the bound)
    assert est.tail_margin() > 1.0
