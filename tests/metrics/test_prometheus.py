"""Prometheus export: names, per-app registries, counters fed from cumulative engine stats."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from roofline.metrics.prometheus import PrometheusStatLogger, metric_value, parse_metrics
from roofline.metrics.stats import FinishedRequestStats, IterationStats, LoggingStatLogger


@dataclass
class Snap:
    num_running: int = 2
    num_waiting: int = 1
    kv_cache_usage: float = 0.25
    num_total_blocks: int = 100
    num_free_blocks: int = 75
    num_cached_blocks: int = 10
    prefix_cache_queries: int = 100
    prefix_cache_hits: int = 40
    num_preemptions: int = 1
    prompt_tokens: int = 100
    generation_tokens: int = 20
    weight_bytes: dict = field(default_factory=lambda: {"Q4_1": 66355200, "float32": 113386752})
    step_roofline: list = field(default_factory=list)


REQUIRED = [
    "roofline:time_to_first_token_seconds_bucket",
    "roofline:inter_token_latency_seconds_bucket",
    "roofline:e2e_request_latency_seconds_bucket",
    "roofline:request_queue_time_seconds_bucket",
    "roofline:num_requests_running",
    "roofline:num_requests_waiting",
    "roofline:kv_cache_usage_perc",
    "roofline:prefix_cache_queries_total",
    "roofline:prefix_cache_hits_total",
    "roofline:num_preemptions_total",
    "roofline:prompt_tokens_total",
    "roofline:generation_tokens_total",
    "roofline:request_success_total",
]


def test_all_metrics_exported_with_values():
    p = PrometheusStatLogger("m")
    p.record(IterationStats(
        timestamp=1.0, engine=Snap(), ttfts=[0.05], itls=[0.01, 0.02],
        finished=[FinishedRequestStats("length", 1.5, 0.1, 0.05, 10, 5),
                  FinishedRequestStats("stop", 0.5, None, 0.04, 10, 3)]))
    m = parse_metrics(p.render().decode())
    for name in REQUIRED:
        assert any(k.split("{")[0] == name for k in m), name
    assert metric_value(m, "roofline:num_requests_running", model_name="m") == 2
    assert metric_value(m, "roofline:num_requests_waiting") == 1
    assert metric_value(m, "roofline:kv_cache_usage_perc") == 0.25
    assert metric_value(m, "roofline:prefix_cache_hits_total") == 40
    assert metric_value(m, "roofline:generation_tokens_total") == 20
    assert metric_value(m, "roofline:request_success_total", finish_reason="length") == 1
    assert metric_value(m, "roofline:request_success_total", finish_reason="stop") == 1
    assert metric_value(m, "roofline:request_success_total", finish_reason="abort") == 0
    assert metric_value(m, "roofline:time_to_first_token_seconds_count") == 1
    assert metric_value(m, "roofline:inter_token_latency_seconds_count") == 2
    assert metric_value(m, "roofline:e2e_request_latency_seconds_count") == 2
    assert metric_value(m, "roofline:request_queue_time_seconds_count") == 1
    assert metric_value(m, "roofline:model_weight_bytes", format="Q4_1") == 66355200
    assert metric_value(m, "roofline:model_weight_bytes", format="float32") == 113386752


def test_counters_follow_cumulative_engine_stats():
    p = PrometheusStatLogger("m")
    p.record(IterationStats(timestamp=1.0, engine=Snap(generation_tokens=20)))
    p.record(IterationStats(timestamp=2.0, engine=Snap(generation_tokens=20)))
    p.record(IterationStats(timestamp=3.0, engine=Snap(generation_tokens=35, num_running=0)))
    m = parse_metrics(p.render().decode())
    assert metric_value(m, "roofline:generation_tokens_total") == 35
    assert metric_value(m, "roofline:num_requests_running") == 0


def test_registries_are_per_logger():
    a, b = PrometheusStatLogger("a"), PrometheusStatLogger("b")  # no "duplicated timeseries" error
    a.record(IterationStats(timestamp=1.0, engine=Snap(num_running=7)))
    mb = parse_metrics(b.render().decode())
    assert metric_value(mb, "roofline:num_requests_running") == 0
    assert 'model_name="a"' not in b.render().decode()


def test_logging_stat_logger_logs_periodically(caplog):
    log = LoggingStatLogger(interval=0.0)
    with caplog.at_level(logging.INFO, logger="roofline.metrics.stats"):
        log.record(IterationStats(timestamp=log._last_time + 1.0, engine=Snap(),
                                  num_new_prompt_tokens=10, num_new_generation_tokens=5))
    assert "generation throughput" in caplog.text
    assert "running 2" in caplog.text


def test_step_roofline_metrics_move_with_each_step():
    from dataclasses import replace

    from roofline.metrics.step_roofline import StepRoofline

    def rec(step, memory, compute, pre, dec):
        return StepRoofline(0.0, step, max(memory, compute), memory, compute, 100.0, 20.0, 1e6, pre, dec, 2, 0.3)

    p = PrometheusStatLogger("m")
    p.record(IterationStats(timestamp=1.0, engine=Snap()))
    m = parse_metrics(p.render().decode())
    assert metric_value(m, "roofline:steps_total") == 0
    snap = replace(Snap(), step_roofline=[rec(0.02, 0.01, 0.001, 0, 2), rec(0.04, 0.01, 0.001, 0, 2),
                                          rec(0.5, 0.01, 0.1, 64, 0)])
    p.record(IterationStats(timestamp=2.0, engine=snap))
    m = parse_metrics(p.render().decode())
    assert metric_value(m, "roofline:steps_total", roof="memory", phase="decode") == 2
    assert metric_value(m, "roofline:steps_total", roof="compute", phase="prefill") == 1
    assert metric_value(m, "roofline:step_time_seconds_count") == 3
    assert metric_value(m, "roofline:step_time_seconds_sum") == pytest.approx(0.56)
    assert metric_value(m, "roofline:step_bound_seconds_sum") == pytest.approx(0.12)
    assert metric_value(m, "roofline:step_ratio_count", phase="decode") == 2
    assert metric_value(m, "roofline:step_bytes_read_total", kind="weights") == 300
    assert metric_value(m, "roofline:step_bytes_read_total", kind="kv", roof="memory") == 40
    assert metric_value(m, "roofline:step_flops_total", roof="compute") == 1e6
    assert metric_value(m, "roofline:step_tokens_total", kind="prefill") == 64
    assert metric_value(m, "roofline:step_tokens_total", kind="decode") == 4
    assert metric_value(m, "roofline:step_roofline_ratio", phase="decode") == pytest.approx(3.0)  # median(2, 4)
    assert metric_value(m, "roofline:step_roofline_ratio", phase="prefill") == pytest.approx(5.0)
    assert metric_value(m, "roofline:step_roofline_ratio", phase="all") == pytest.approx(4.0)


def test_the_schedulers_plan_is_exported():
    """Each step's predicted time (beside the measured one), token budget and its target, draft length; records
    without a plan (no estimate, no budget, no speculation) add nothing to those series."""
    from dataclasses import replace

    from roofline.metrics.step_roofline import StepRoofline

    def rec(step, predicted=0.0, budget=0, target=0.0, k=-1, margin=0.0):
        return StepRoofline(0.0, step, 0.01, 0.01, 0.001, 100.0, 20.0, 1e6, 0, 2, 2, 0.3, predicted, budget, target, k,
                            margin)

    p = PrometheusStatLogger("m")
    p.record(IterationStats(timestamp=1.0, engine=replace(Snap(), step_roofline=[rec(0.02)])))
    m = parse_metrics(p.render().decode())
    for name in ("step_predicted_seconds_count", "step_token_budget_count", "step_draft_length_count"):
        assert metric_value(m, "roofline:" + name) == 0, name
    assert metric_value(m, "roofline:step_tail_margin") == 0
    snap = replace(Snap(), step_roofline=[rec(0.02, 0.01, 300, 0.03, 0, 1.0), rec(0.04, 0.02, 100, 0.025, 3, 1.08),
                                          rec(0.03, 0.01, 0, 0.0, 2)])
    p.record(IterationStats(timestamp=2.0, engine=snap))
    m = parse_metrics(p.render().decode())
    assert metric_value(m, "roofline:step_predicted_seconds_count", phase="decode") == 3
    assert metric_value(m, "roofline:step_predicted_seconds_sum") == pytest.approx(0.04)
    assert metric_value(m, "roofline:step_prediction_ratio") == pytest.approx(2.0)  # median(2, 2, 3)
    assert metric_value(m, "roofline:step_token_budget_count") == 2
    assert metric_value(m, "roofline:step_token_budget_sum") == 400
    assert metric_value(m, "roofline:step_token_budget_bucket", le="256.0") == 1
    assert metric_value(m, "roofline:step_target_seconds") == 0.025  # the last budgeted step's
    assert metric_value(m, "roofline:step_tail_margin") == 1.08  # the last step that carried one
    assert metric_value(m, "roofline:step_draft_length_count") == 3
    assert metric_value(m, "roofline:step_draft_length_sum") == 5
    assert metric_value(m, "roofline:step_draft_length_bucket", le="0.0") == 1


def test_histogram_quantile_matches_prometheus():
    from roofline.metrics.prometheus import histogram_quantile

    # 10 observations: 4 in (0, 1], 4 in (1, 2], 2 in (2, 4]
    b = [(1.0, 4.0), (2.0, 8.0), (4.0, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(1.25)  # rank 5: a quarter into (1, 2]
    assert histogram_quantile(0.2, b) == pytest.approx(0.5)
    assert histogram_quantile(0.9, b) == pytest.approx(3.0)
    assert histogram_quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) != histogram_quantile(0.5, b)  # nan
    assert histogram_quantile(0.99, [(1.0, 1.0), (float("inf"), 5.0)]) == 1.0  # in the +Inf bucket: its lower bound


def test_collectives_and_expert_balancedness_are_exported():
    """Distributed stats: collective counters grow by the engine's cumulative deltas, balancedness per layer."""
    from roofline.engine.engine_core import EngineStats
    from roofline.metrics.prometheus import PrometheusStatLogger, metric_value, parse_metrics
    from roofline.metrics.stats import IterationStats

    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_total_blocks=1, num_free_blocks=1,
                num_cached_blocks=0, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                prompt_tokens=0, generation_tokens=0)
    log = PrometheusStatLogger("m")
    log.record(IterationStats(0.0, EngineStats(**base, collectives={"ep.all_to_all": [8, 1000]}, parallel_steps=2,
                                               expert_balancedness=[0.4, 0.5], eplb_rebalances=0)))
    log.record(IterationStats(1.0, EngineStats(**base, collectives={"ep.all_to_all": [12, 1500],
                                                                    "tp.all_reduce": [3, 30]}, parallel_steps=3,
                                               expert_balancedness=[0.95, 0.9], eplb_rebalances=1)))
    m = parse_metrics(log.render().decode())
    assert metric_value(m, "roofline:collective_calls_total", group="ep", op="all_to_all") == 12
    assert metric_value(m, "roofline:collective_bytes_total", group="ep", op="all_to_all") == 1500
    assert metric_value(m, "roofline:collective_bytes_total", group="tp", op="all_reduce") == 30
    assert metric_value(m, "roofline:parallel_steps_total") == 3
    assert metric_value(m, "roofline:eplb_rebalances_total") == 1
    assert metric_value(m, "roofline:expert_balancedness", layer="0") == 0.95
    assert metric_value(m, "roofline:expert_balancedness", layer="1") == 0.9


def test_spec_decode_counters_follow_the_engine_totals():
    from roofline.core.spec_decode_stats import SpecDecodeStats

    spec = SpecDecodeStats(3)
    spec.observe(3, 2)
    spec.observe(3, 3)
    p = PrometheusStatLogger("m")
    snap = Snap()
    snap.spec_decode = spec.copy()
    p.record(IterationStats(timestamp=1.0, engine=snap))
    spec.observe(2, 0)
    snap.spec_decode = spec.copy()
    p.record(IterationStats(timestamp=2.0, engine=snap))
    m = parse_metrics(p.render().decode())
    assert metric_value(m, "roofline:spec_decode_num_drafts_total") == 3
    assert metric_value(m, "roofline:spec_decode_num_draft_tokens_total") == 8
    assert metric_value(m, "roofline:spec_decode_num_accepted_tokens_total") == 5
    per_pos = [metric_value(m, "roofline:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(3)]
    assert per_pos == [2, 2, 1]


def test_no_spec_decode_counters_without_speculation():
    p = PrometheusStatLogger("m")
    p.record(IterationStats(timestamp=1.0, engine=Snap()))
    m = parse_metrics(p.render().decode())
    assert metric_value(m, "roofline:spec_decode_num_drafts_total") == 0


def test_vllm_names_equal_ours():
    """Every metric of VLLM_MIRRORED is rendered a second time as vllm:<name> (what a gateway's scorers read)
    with exactly our samples: histograms' buckets, counters' totals, labelled children."""
    from roofline.metrics.prometheus import VLLM_MIRRORED
    from roofline.core.spec_decode_stats import SpecDecodeStats

    p = PrometheusStatLogger("m", lora=True)
    snap = Snap()
    spec = SpecDecodeStats(2)
    spec.observe(2, 1)
    snap.spec_decode = spec.copy()
    snap.max_lora, snap.running_lora_adapters, snap.waiting_lora_adapters = 2, ["a1"], []
    p.record(IterationStats(
        timestamp=1.0, engine=snap, ttfts=[0.05], itls=[0.01, 0.02],
        finished=[FinishedRequestStats("length", 1.5, 0.1, 0.05, 10, 5)]))
    m = parse_metrics(p.render().decode())
    ours = {k[len("roofline:"):]: v for k, v in m.items() if k.startswith("roofline:")}
    theirs = {k[len("vllm:"):]: v for k, v in m.items() if k.startswith("vllm:")}
    assert theirs == {k: v for k, v in ours.items() if k.split("{")[0].removesuffix("_total").removesuffix(
        "_bucket").removesuffix("_count").removesuffix("_sum").removesuffix("_created") in VLLM_MIRRORED}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "time_to_first_token_seconds_count", "lora_requests_info"):
        assert any(k.split("{")[0] == name for k in theirs), name
    assert metric_value(m, "vllm:num_requests_waiting", model_name="m") == 1
    assert metric_value(m, "vllm:prefix_cache_hits_total") == 40


def test_lora_requests_info_keeps_one_series_of_the_current_adapters():
    p = PrometheusStatLogger("m", lora=True)
    snap = Snap()
    snap.max_lora, snap.running_lora_adapters, snap.waiting_lora_adapters = 4, ["a1", "a2"], ["a3"]
    p.record(IterationStats(timestamp=1.0, engine=snap))
    snap.running_lora_adapters, snap.waiting_lora_adapters = ["a3"], []
    p.record(IterationStats(timestamp=2.0, engine=snap))
    series = [k for k in parse_metrics(p.render().decode()) if k.startswith("vllm:lora_requests_info")]
    assert len(series) == 1
    assert 'running_lora_adapters="a3"' in series[0] and 'waiting_lora_adapters=""' in series[0]
    assert 'max_lora="4"' in series[0]
    assert not any("lora_requests_info" in k for k in parse_metrics(PrometheusStatLogger("m").render().decode()))
