"""The live roofline through the server: /metrics step series appear and move under load, /stats and
/dashboard answer (a tiny random Llama, token-id prompts)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app
from roofline.metrics.prometheus import metric_value, parse_metrics


@pytest.fixture(scope="module")
def engine(tiny_models):
    """The module's engine: under the open server below, and under the API-key test's server of its own."""
    path = tiny_models["llama"][0]
    eng = AsyncLLM.from_engine_args(EngineArgs(model=path, device="cpu", dtype="float32", num_kv_blocks=128,
                                               max_model_len=256, seed=0))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=5.0)
    srv = ServerThread(build_app(engine, config, shutdown_engine=False), config=config).start()
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        yield http
    srv.stop()


def _metrics(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def _complete(http, prompt_len: int, max_tokens: int, first: int = 3) -> None:
    r = http.post("/v1/completions", json={"prompt": list(range(first, first + prompt_len)), "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def _wait(http, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(http)
        if cond(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_step_metrics_appear_and_move_under_load(server, tiny_models):
    http = server
    before = _metrics(http)
    steps0 = metric_value(before, "roofline:steps_total")
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _complete(http, 20 + 10 * i, 12, first=3 + 50 * i), range(4)))  # no shared prefix
    after = _wait(http, lambda m: metric_value(m, "roofline:num_requests_running") == 0
                  and metric_value(m, "roofline:steps_total") > steps0)
    steps = metric_value(after, "roofline:steps_total") - steps0
    assert steps >= 12  # at least one step per generated token of the longest request
    assert metric_value(after, "roofline:step_time_seconds_count") - metric_value(
        before, "roofline:step_time_seconds_count") == steps
    assert metric_value(after, "roofline:step_bound_seconds_sum") > metric_value(before, "roofline:step_bound_seconds_sum")
    for kind in ("weights", "kv"):
        assert metric_value(after, "roofline:step_bytes_read_total", kind=kind) > metric_value(
            before, "roofline:step_bytes_read_total", kind=kind)
    assert metric_value(after, "roofline:step_flops_total") > metric_value(before, "roofline:step_flops_total")
    prefill = metric_value(after, "roofline:step_tokens_total", kind="prefill") - metric_value(
        before, "roofline:step_tokens_total", kind="prefill")
    decode = metric_value(after, "roofline:step_tokens_total", kind="decode") - metric_value(
        before, "roofline:step_tokens_total", kind="decode")
    # every prompt token is prefilled once; each later token is fed back once (a 1-token chunk counts as decode)
    assert prefill + decode == sum(20 + 10 * i for i in range(4)) + 4 * 11
    assert metric_value(after, "roofline:step_roofline_ratio", phase="all") > 0
    assert metric_value(after, "roofline:step_roofline_ratio", phase="decode") > 0
    assert any(k.startswith("roofline:steps_total{") and 'roof="' in k for k in after)
    # the tiny model's weights: all fp32 (safetensors), 4 bytes for each of HF's parameters
    hf_params = sum(p.numel() for p in tiny_models["llama"][1].parameters())
    assert metric_value(after, "roofline:model_weight_bytes", format="float32") == 4 * hf_params


def test_stats_endpoint_and_dashboard_page(server):
    http = server
    _complete(http, 40, 8, first=300)
    _wait(http, lambda m: metric_value(m, "roofline:num_requests_running") == 0)
    s = http.get("/stats")
    assert s.status_code == 200
    doc = s.json()
    assert doc["model"] and doc["steps"], doc
    last = doc["steps"][-1]
    for key in ("step_ms", "bound_ms", "ratio", "roof", "phase", "prefill_tokens", "decode_tokens", "kv_cache_usage"):
        assert key in last, key
    assert any(st["prefill_tokens"] >= 40 for st in doc["steps"])
    assert any(st["phase"] == "decode" for st in doc["steps"])
    assert doc["roofline"]["window_median_ratio"]["all"] > 0
    assert doc["roofline"]["totals"]["steps"] >= len(doc["steps"])
    assert doc["device"]["bandwidth_bytes_per_s"] > 0 and doc["device"]["peak_flops"] > 0
    assert doc["engine"]["num_free_blocks"] == doc["engine"]["num_total_blocks"]
    page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'fetch("/stats"' in page.text and "<canvas" in page.text


def test_the_schedulers_plan_is_on_metrics_and_stats(server):
    """The token budget, the predicted against the measured step time and the draft length (no speculation here:
    the series is there, empty) on /metrics and in /stats."""
    http = server
    before = _metrics(http)
    with cf.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: _complete(http, 30 + 20 * i, 10, first=200 + 60 * i), range(2)))
    after = _wait(http, lambda m: metric_value(m, "roofline:num_requests_running") == 0)
    steps = metric_value(after, "roofline:steps_total") - metric_value(before, "roofline:steps_total")
    predicted = (metric_value(after, "roofline:step_predicted_seconds_count")
                 - metric_value(before, "roofline:step_predicted_seconds_count"))
    assert steps >= 10 and predicted == steps  # every step predicted (the budget is on by default)
    assert metric_value(after, "roofline:step_predicted_seconds_sum") > 0
    assert metric_value(after, "roofline:step_prediction_ratio") > 0
    # a prompt waiting for tokens: the step got a budget (max_num_batched_tokens when no decode ran)
    assert metric_value(after, "roofline:step_token_budget_count") > metric_value(before, "roofline:step_token_budget_count")
    assert "roofline:step_target_seconds" in {k.split("{")[0] for k in after}
    assert metric_value(after, "roofline:step_tail_margin") >= 1.0
    assert metric_value(after, "roofline:step_draft_length_count") == 0
    doc = http.get("/stats").json()
    assert all(st["predicted_ms"] > 0 and st["draft_length"] is None for st in doc["steps"])
    assert any(st["token_budget"] for st in doc["steps"])


def test_bench_serve_reports_the_live_ratio_per_phase(server):
    """`roofline bench serve`'s live roofline: the server's step metrics between two scrapes."""
    import asyncio

    from roofline.benchmarks import serve as bench
    from roofline.benchmarks.datasets import random_requests
    from roofline.metrics.step_roofline import format_phase_medians

    http = server
    cfg = bench.BenchConfig(base_url=str(http.base_url).rstrip("/"), disable_tqdm=True, num_warmups=0)
    reqs = random_requests(6, (40, 60), (6, 10), seed=0, vocab_size=384)
    before = bench.scrape_metrics(cfg)
    steps_before = metric_value(before, "roofline:steps_total")
    results, duration = asyncio.run(bench.run_requests(cfg, reqs))  # the model from /v1/models
    assert all(r.success for r in results), [r.error for r in results]
    after = _wait(http, lambda m: metric_value(m, "roofline:num_requests_running") == 0)
    live = bench.live_roofline(before, after)
    assert live["all"]["steps"] == metric_value(after, "roofline:steps_total") - steps_before
    assert live["decode"]["steps"] >= 5 and live["decode"]["median_ratio"] >= 1.0
    assert sum(live[p]["steps"] for p in ("prefill", "decode", "mixed") if p in live) == live["all"]["steps"]
    assert live["all"]["mean_step_ms"] > live["all"]["mean_bound_ms"] > 0
    m = bench.compute_metrics(results, duration)
    m["live_roofline"] = live
    report = bench.format_report(m)
    assert "live roofline (step time / bound, median)" in report and "decode" in report
    assert format_phase_medians(live) in report


def test_api_key_covers_stats_but_not_the_static_page(engine):
    config = ServerConfig(api_key="sk-live", uvicorn_log_level="warning", access_log=False, shutdown_timeout=5.0)
    srv = ServerThread(build_app(engine, config, shutdown_engine=False), config=config).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            assert http.get("/stats").status_code == 401  # the data needs the key
            assert http.get("/stats", headers={"Authorization": "Bearer sk-live"}).status_code == 200
            page = http.get("/dashboard")  # the page holds no data: a browser can open it, it asks for the key
            assert page.status_code == 200 and "/stats" in page.text
    finally:
        srv.stop()
