"""`roofline bench throughput` reports the live roofline per phase next to its throughput."""

from __future__ import annotations

from roofline.benchmarks.datasets import random_requests
from roofline.benchmarks.throughput import _live_lines, _run_offline


def test_offline_run_reports_median_ratio_per_phase(tiny_models):
    from roofline import LLM

    llm = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", num_kv_blocks=128, show_progress=False)
    reqs = random_requests(6, (20, 40), (4, 12), seed=0, vocab_size=384)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)  # steps before the run are not counted
    res = _run_offline(llm, reqs)
    live = res["live_roofline"]
    steps = live["all"]["steps"]
    assert steps == sum(live[p]["steps"] for p in ("prefill", "decode", "mixed") if p in live)
    assert live["prefill"]["steps"] >= 1 and live["decode"]["steps"] >= 7  # the longest output runs alone
    assert live["decode"]["median_ratio"] > 0 and 0 <= live["decode"]["memory_bound_share"] <= 1
    res.pop("outputs")
    lines = _live_lines({"workload": "W1", "roofline": res})
    assert len(lines) == 1 and lines[0][0] == "roofline" and "decode" in lines[0][1]

    off = LLM(tiny_models["llama"][0], dtype="float32", device="cpu", num_kv_blocks=128, show_progress=False,
              step_roofline=False)
    assert _run_offline(off, reqs)["live_roofline"].startswith("off")
