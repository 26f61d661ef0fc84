"""The planner's pipeline parallelism: per-stage weights and KV (the engine's split), the pool as the
smallest stage's, the bubble (pp - 1) / (m + pp - 1), activation bytes between stages, the CLI."""

from __future__ import annotations

import argparse
import json

import pytest

from roofline.distributed.layout import stage_layer_ranges
from roofline.planner import cli
from roofline.planner.cost_model import (
    PlanInputs,
    make_plan,
    pipeline_stages,
    pp_bubble_fraction,
    weight_bytes_per_gpu,
)
from roofline.planner.hardware import GiB, get_hardware
from roofline.planner.model_specs import load_model_spec


def _inputs(model="llama-3-70b", **kw) -> PlanInputs:
    return PlanInputs(model=load_model_spec(model), hardware=get_hardware("h100-sxm"), **kw)


def test_stage_weights_add_up_to_the_model():
    p1, p4 = _inputs(tp=2), _inputs(tp=2, pp=4)
    stages = pipeline_stages(p4)
    assert [s["layers"] for s in stages] == [list(r) for r in stage_layer_ranges(80, 4)]
    assert sum(s["weight_bytes"] for s in stages) == pytest.approx(weight_bytes_per_gpu(p1), rel=1e-12)
    # the ends hold the embedding and the LM head, so they are the heavier stages
    assert stages[0]["weight_bytes"] > stages[1]["weight_bytes"] < stages[3]["weight_bytes"]
    assert weight_bytes_per_gpu(p4) == max(s["weight_bytes"] for s in stages)
    assert sum(s["kv_bytes_per_token"] for s in stages) == pytest.approx(make_plan(p1).results["kv_bytes_per_token"])


def test_tied_embeddings_are_held_twice_across_stages():
    """SmolLM2 ties its LM head to the embedding: at pp=2 the last stage loads its own copy."""
    p1, p2 = _inputs("smollm2-135m"), _inputs("smollm2-135m", pp=2)
    m = p1.model
    extra = m.embedding_params * p1.weight_bytes
    assert sum(s["weight_bytes"] for s in pipeline_stages(p2)) == pytest.approx(weight_bytes_per_gpu(p1) + extra)


@pytest.mark.parametrize("pp, m, expected", [(1, 1, 0.0), (2, 1, 0.5), (2, 2, 1 / 3), (4, 4, 3 / 7), (3, 12, 2 / 14)])
def test_bubble_formula(pp, m, expected):
    assert pp_bubble_fraction(pp, m) == pytest.approx(expected)


def test_pool_is_the_smallest_stages_and_activations_between_stages():
    budget = 10 * GiB
    one = make_plan(_inputs(kv_budget_bytes=budget)).results
    two = make_plan(_inputs(pp=2, kv_budget_bytes=budget, batch=64, max_num_batched_tokens=1024)).results
    pipe = two["pipeline"]
    # each stage caches half the layers: the same budget holds twice the blocks
    assert two["kv_blocks"] == pipe["kv_blocks"] == 2 * one["kv_blocks"]
    assert pipe["bubble_fraction"] == pytest.approx(1 / 3) and pipe["microbatches"] == 2
    d = 8192  # Llama-3-70B hidden size; bf16 hidden states and residual
    assert pipe["activation_bytes_per_decode_step"] == 2 * 64 * d * 2
    assert pipe["activation_bytes_per_prefill_chunk"] == 2 * 1024 * d * 2
    assert pipe["decode_round_ms"] == pytest.approx(3 * pipe["decode_stage_step_ms"])
    assert "pipeline" not in one


def test_partition_override_and_errors():
    stages = pipeline_stages(_inputs(pp=2, pp_layer_partition=[50, 30]))
    assert [s["num_layers"] for s in stages] == [50, 30]
    with pytest.raises(ValueError, match="80 layers"):
        pipeline_stages(_inputs(pp=2, pp_layer_partition=[50, 20]))


def _run(argv, capsys):
    parser = argparse.ArgumentParser(prog="roofline")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_cli_pp(capsys):
    rc, out = _run(["--model", "llama-3-70b", "--gpu", "h100-sxm", "--tp", "2", "--pp", "2", "--json"], capsys)
    assert rc == 0
    d = json.loads(out)
    assert d["inputs"]["pp"] == 2 and len(d["pipeline"]["stages"]) == 2
    rc, out = _run(["--model", "llama-3-70b", "--gpu", "h100-sxm", "--pp", "4", "--microbatches", "8",
                    "--pp-layer-partition", "20,20,20,20"], capsys)
    assert rc == 0
    assert "PP=4" in out and "Pipeline: 4 stages, 8 batches in flight" in out and "bubble_fraction" in out
    assert f"{3 / 11:.3f}" in out
