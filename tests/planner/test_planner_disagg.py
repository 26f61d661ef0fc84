"""`roofline plan --disagg`: the prefill:decode engine count from the M/D/1 prefill queue against the TTFT
SLO and the decode batch against the TPOT SLO and the KV pool (planner/disagg.py)."""

from __future__ import annotations

import json
import math

import pytest

from roofline.planner.cli import main
from roofline.planner.cost_model import PlanInputs, decode_at, kv_bytes_per_token, prefill
from roofline.planner.disagg import (DisaggWorkload, decode_batch_limit, plan_disagg, prefill_rate_limit,
                                     transferred_kv_bytes)
from roofline.planner.hardware import get_hardware
from roofline.planner.model_specs import load_model_spec


def inputs(**kw) -> PlanInputs:
    return PlanInputs(load_model_spec("llama-3-8b"), get_hardware("h100-sxm"), **kw)


def test_prefill_queue_limit_is_md1():
    t_p, slo = 0.1, 0.3  # a = 2: rho = 4/5
    lam = prefill_rate_limit(t_p, 0.0, slo)
    assert lam == pytest.approx(0.8 / t_p)
    rho = lam * t_p
    assert t_p + rho * t_p / (2 * (1 - rho)) == pytest.approx(slo)  # exactly at the SLO
    assert prefill_rate_limit(t_p, 0.25, slo) == 0.0  # the transfer eats the budget


def test_transferred_bytes_are_the_blocks_of_every_prompt_token_but_the_last():
    p = inputs(block_size=16)
    assert transferred_kv_bytes(p, 33) == 32 * kv_bytes_per_token(p)
    assert transferred_kv_bytes(p, 32) == 32 * kv_bytes_per_token(p)  # 31 tokens: the second block partial
    assert transferred_kv_bytes(p, 17) == 16 * kv_bytes_per_token(p)
    assert transferred_kv_bytes(p, 1) == 0


def test_decode_batch_respects_tpot_and_kv():
    p = inputs()
    w = DisaggWorkload(1024, 256, 10, 1.0, 0.02)
    d = decode_batch_limit(p, w)
    b = d["batch"]
    live = 1024 + 128
    assert b >= 1 and decode_at(p, b, live)["step_time_s"] <= 0.02
    assert b == d["kv_max_batch"] or decode_at(p, b + 1, live)["step_time_s"] > 0.02


def test_plan_counts_and_ratio():
    p = inputs()
    w = DisaggWorkload(2048, 256, 40, 0.5, 0.04)
    d = plan_disagg(p, w)
    assert d["feasible"]
    assert d["prefill_engines"] == math.ceil(40 / d["prefill_max_rate_per_engine"])
    assert d["decode_engines"] == math.ceil(40 / d["decode_max_rate_per_engine"])
    assert d["prefill_s"] == pytest.approx(prefill(p, 2048)["prefill_s"])
    # long prompts, short answers want more prefill engines; the reverse more decode engines
    long_in = plan_disagg(p, DisaggWorkload(8192, 64, 40, 1.0, 0.04))
    long_out = plan_disagg(p, DisaggWorkload(256, 2048, 40, 1.0, 0.04))
    assert long_in["prefill_engines"] / long_in["decode_engines"] > long_out["prefill_engines"] / long_out["decode_engines"]
    # twice the rate never needs fewer engines
    double = plan_disagg(p, DisaggWorkload(2048, 256, 80, 0.5, 0.04))
    assert double["prefill_engines"] >= d["prefill_engines"] and double["decode_engines"] >= d["decode_engines"]


def test_infeasible_slos_say_why():
    d = plan_disagg(inputs(), DisaggWorkload(8192, 64, 1, 0.001, 0.04))
    assert not d["feasible"] and "TTFT" in d["why_not"]
    d = plan_disagg(inputs(), DisaggWorkload(512, 64, 1, 1.0, 1e-6))
    assert not d["feasible"] and "TPOT" in d["why_not"]
    with pytest.raises(ValueError):
        DisaggWorkload(0, 1, 1, 1, 1)


def test_cli(capsys):
    assert main(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--disagg", "--input-len", "2048", "--output-len",
                 "256", "--request-rate", "40", "--ttft-slo", "0.5", "--tpot-slo", "0.04", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["feasible"] and d["ratio"] and d["kv_bytes_per_request"] > 0
    assert main(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--disagg"]) == 0
    assert "prefill:decode =" in capsys.readouterr().out
    assert main(["--model", "llama-3-8b", "--gpu", "h100-sxm", "--disagg", "--request-rate", "0"]) == 2
