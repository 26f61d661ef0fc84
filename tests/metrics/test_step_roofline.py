"""The live roofline's accounting equals the planner's numbers for the same batch; the engine records it."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from roofline.metrics.step_roofline import (StepRoofline, StepRooflineModel, format_phase_medians, phase_medians,
                                            resolve_hardware)
from roofline.planner.cost_model import PlanInputs, decode_at, prefill
from roofline.planner.hardware import get_hardware
from roofline.planner.model_specs import MODEL_PRESETS, ModelSpec


def _req(start: int, n: int):
    return SimpleNamespace(num_computed_tokens=start, token_ids=list(range(n)))


CASES = [("llama-3-8b", "h100-sxm", 1), ("llama-3-70b", "h200", 4), ("deepseek-v3", "h200", 8),
         ("qwen3-8b", "a100-80gb", 2)]


@pytest.mark.parametrize("model,gpu,tp", CASES)
@pytest.mark.parametrize("batch,context", [(1, 1), (8, 512), (64, 4096), (512, 2000)])
def test_decode_step_equals_planner(model, gpu, tp, batch, context):
    spec = ModelSpec.from_hf_config(MODEL_PRESETS[model], name=model)
    hw = get_hardware(gpu)
    acc = StepRooflineModel(spec, hw, "bf16", tp=tp)
    # `batch` sequences, each attending to `context` positions after the step: computed context - 1
    rec = acc.account([_req(context - 1, 1) for _ in range(batch)], step_time_s=0.05)
    plan = decode_at(PlanInputs(spec, hw, tp=tp, weight_dtype="bf16", batch=batch, context=context,
                                avg_context=context), batch)
    assert rec.flops == pytest.approx(plan["flops"], rel=1e-12)
    assert rec.weight_bytes == pytest.approx(plan["weight_bytes_read"], rel=1e-12)
    assert rec.kv_bytes == pytest.approx(plan["kv_bytes_read"], rel=1e-12)
    assert rec.bound_s == pytest.approx(plan["step_time_s"], rel=1e-12)
    assert rec.roof == plan["bound"]
    assert rec.phase == "decode" and rec.decode_tokens == batch and rec.prefill_tokens == 0
    assert rec.ratio == pytest.approx(0.05 / plan["step_time_s"])


@pytest.mark.parametrize("model,gpu,tp", CASES)
@pytest.mark.parametrize("n", [2, 128, 4096])
def test_prefill_step_equals_planner(model, gpu, tp, n):
    spec = ModelSpec.from_hf_config(MODEL_PRESETS[model], name=model)
    hw = get_hardware(gpu)
    rec = StepRooflineModel(spec, hw, "bf16", tp=tp).account([_req(0, n)], step_time_s=1.0)
    plan = prefill(PlanInputs(spec, hw, tp=tp, weight_dtype="bf16", context=n), n)
    assert rec.flops == pytest.approx(plan["prefill_flops"], rel=1e-12)
    assert rec.bytes_read == pytest.approx(plan["prefill_bytes"], rel=1e-12)
    assert rec.bound_s == pytest.approx(plan["prefill_s"], rel=1e-12)
    assert rec.roof == plan["prefill_bound"]
    assert rec.phase == "prefill" and rec.prefill_tokens == n


def test_chunked_prefill_adds_up_to_the_whole_prompt():
    """Attention FLOPs and tokens of a prompt prefilled in chunks sum to the one-shot figures."""
    spec = ModelSpec.from_hf_config(MODEL_PRESETS["llama-3-8b"])
    acc = StepRooflineModel(spec, get_hardware("h100-sxm"), "bf16")
    whole = acc.account([_req(0, 1000)], 1.0)
    chunks = [acc.account([_req(s, 250)], 1.0) for s in range(0, 1000, 250)]
    linear = lambda r: acc.linear_flops_per_token * (r.prefill_tokens + r.decode_tokens)  # noqa: E731
    assert sum(c.flops - linear(c) for c in chunks) == pytest.approx(whole.flops - linear(whole), rel=1e-12)
    # each chunk reads the whole weights again and the KV of everything before it
    assert chunks[-1].kv_bytes == pytest.approx(whole.kv_bytes)
    assert sum(c.weight_bytes for c in chunks) == pytest.approx(4 * whole.weight_bytes)


def test_mixed_step_is_the_sum_of_its_parts():
    spec = ModelSpec.from_hf_config(MODEL_PRESETS["llama-3-8b"])
    acc = StepRooflineModel(spec, get_hardware("h100-sxm"), "bf16")
    decodes = [_req(300 + i, 1) for i in range(10)]
    rec = acc.account(decodes + [_req(64, 200)], 0.02)
    assert (rec.prefill_tokens, rec.decode_tokens, rec.num_requests) == (200, 10, 11)
    assert rec.phase == "prefill"
    attn = spec.attention_flops_per_token(1.0, "decode") * sum(301 + i for i in range(10)) \
        + spec.attention_flops_per_token(1.0, "prefill") * sum(range(65, 265))
    assert rec.flops == pytest.approx(2 * spec.active_params() * 210 + attn, rel=1e-12)
    assert rec.kv_bytes == pytest.approx(acc.kv_bytes_per_token * (sum(301 + i for i in range(10)) + 264))
    assert acc.account(decodes + [_req(0, 5)], 0.02).phase == "mixed"


def _gemma3_1b():
    """Gemma-3-1B's shape: 22 of 26 layers see their last 512 positions (tests/planner/test_planner_specs.py)."""
    from transformers import Gemma3TextConfig

    return ModelSpec.from_hf_config(Gemma3TextConfig(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=512, vocab_size=262144, max_position_embeddings=32768))


def test_sliding_layers_read_and_attend_to_their_window_only():
    """A decode step past the window reads 4 full layers' contexts and 22 windows (what the planner's decode_at
    says), and attends likewise; a prefill chunk's sliding layers read the union of its tokens' windows, and
    the chunks' attention FLOPs add up to the whole prompt's (the planner's prefill)."""
    spec = _gemma3_1b()
    hw = get_hardware("h100-sxm")
    acc = StepRooflineModel(spec, hw, "bf16")
    per_layer = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bf16
    context, batch = 4096, 8
    rec = acc.account([_req(context - 1, 1) for _ in range(batch)], step_time_s=0.01)
    assert rec.kv_bytes == batch * (4 * context + 22 * 512) * per_layer
    assert rec.flops == pytest.approx(batch * (2 * spec.active_params() + 2.0 * (4 * context + 22 * 512) * 4 * 512))
    plan = decode_at(PlanInputs(spec, hw, weight_dtype="bf16", batch=batch, context=context, avg_context=context),
                     batch)
    for key, got in (("kv_bytes_read", rec.kv_bytes), ("flops", rec.flops), ("step_time_s", rec.bound_s)):
        assert got == pytest.approx(plan[key], rel=1e-12), key
    # within the window every layer reads everything
    assert acc.account([_req(299, 1)], 0.01).kv_bytes == 26 * 300 * per_layer

    # a 256-token chunk after 2000 tokens: sliding layers read positions 1745..2255 (the first query's window on)
    chunk = acc.account([_req(2000, 256)], 0.1)
    assert chunk.kv_bytes == (4 * 2256 + 22 * (512 + 255)) * per_layer
    linear = lambda r: acc.linear_flops_per_token * r.prefill_tokens  # noqa: E731
    attn = lambda p: spec.attention_flops_per_token(p, "prefill")  # noqa: E731 (token at p - 1 sees p positions)
    assert chunk.flops - linear(chunk) == pytest.approx(sum(attn(p) for p in range(2001, 2257)), rel=1e-12)
    whole = acc.account([_req(0, 3000)], 1.0)
    chunks = [acc.account([_req(st, 500)], 1.0) for st in range(0, 3000, 500)]
    assert sum(c.flops - linear(c) for c in chunks) == pytest.approx(whole.flops - linear(whole), rel=1e-12)
    pre = prefill(PlanInputs(spec, hw, weight_dtype="bf16", context=3000), 3000)
    assert whole.flops == pytest.approx(pre["prefill_flops"], rel=1e-12)
    assert whole.bytes_read == pytest.approx(pre["prefill_bytes"], rel=1e-12)


@pytest.mark.parametrize("model", ["deepseek-v3", "llama-3-8b"])
def test_attention_flops_over_is_the_sum_per_token(model):
    """ModelSpec.attention_flops_over's closed form: the per-token figure summed, across the window / top-k."""
    specs = [ModelSpec.from_hf_config(MODEL_PRESETS[model]), _gemma3_1b()]
    if model == "deepseek-v3":  # a DSA-shaped spec: top-k 64, the indexer past it
        specs.append(dataclasses.replace(specs[0], index_topk=64, index_n_heads=8, index_head_dim=32))
    for spec in specs:
        for start, end in ((0, 1), (0, 100), (40, 700), (511, 513), (600, 900)):
            for phase in ("decode", "prefill"):
                want = sum(spec.attention_flops_per_token(p, phase) for p in range(start + 1, end + 1))
                assert spec.attention_flops_over(start, end, phase) == pytest.approx(want, rel=1e-12)


def test_phase_medians_and_line():
    def rec(step, bound, pre, dec):
        return StepRoofline(0.0, step, bound, bound, bound / 2, 1.0, 1.0, 1.0, pre, dec, 1, 0.1)

    recs = [rec(0.02, 0.01, 0, 4), rec(0.03, 0.01, 0, 4), rec(0.05, 0.01, 0, 4), rec(0.4, 0.1, 100, 0)]
    s = phase_medians(recs)
    assert s["decode"]["steps"] == 3 and s["decode"]["median_ratio"] == pytest.approx(3.0)
    assert s["prefill"]["median_ratio"] == pytest.approx(4.0)
    assert s["all"]["steps"] == 4
    line = format_phase_medians(s)
    assert "prefill 4.00x" in line and "decode 3.00x" in line
    assert "no steps" in format_phase_medians(phase_medians([]))
    assert math.isinf(rec(1.0, 0.0, 0, 1).ratio)


def test_hardware_preset_and_measured_once():
    assert resolve_hardware("cpu", "float32", "h100-sxm").name == "h100-sxm"
    a = resolve_hardware("cpu", "float32")
    assert a.measured and a.hbm_bandwidth > 1e8 and a.flops_for("fp32") > 1e8
    assert resolve_hardware("cpu", "float32") is a  # measured once per process
    assert resolve_hardware("cpu", "float32", "cpu") is a  # the unmeasured placeholder means "measure"


def test_engine_records_every_step_and_switch_turns_it_off(tiny_models):
    from roofline import LLM, SamplingParams

    path = tiny_models["llama"][0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 3)]
    on = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    on.llm_engine.get_stats()
    outs_on = on.generate(prompts, sp, use_tqdm=False)
    st = on.llm_engine.get_stats()
    recs = st.step_roofline
    assert len(recs) == 6  # one prefill step for both prompts, then 5 decode steps
    assert recs[0].phase == "prefill" and recs[0].prefill_tokens == 10
    assert all(r.phase == "decode" and r.decode_tokens == 2 for r in recs[1:])
    assert all(r.step_time_s > 0 and r.bound_s > 0 and r.flops > 0 for r in recs)
    # decode KV grows by one position per sequence per step
    kv = [r.kv_bytes for r in recs[1:]]
    assert all(b - a == pytest.approx(2 * on.llm_engine.step_roofline.kv_bytes_per_token) for a, b in zip(kv, kv[1:]))
    assert on.llm_engine.get_stats().step_roofline == []  # drained by the previous snapshot
    assert st.num_free_blocks == st.num_total_blocks

    # off: no records; the model stays while the token budget plans with it, and goes with the budget off too
    # (offline LLM: the budget only with a target given)
    off = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False, step_roofline=False,
              target_itl_ms=50)
    outs_off = off.generate(prompts, sp, use_tqdm=False)
    assert off.llm_engine.step_time is not None and off.llm_engine.get_stats().step_roofline == []
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    none = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False, step_roofline=False)
    assert none.llm_engine.step_roofline is None and none.llm_engine.step_time is None


def test_bad_hardware_name_is_named():
    from roofline.config import EngineArgs

    with pytest.raises(ValueError, match="roofline_hardware"):
        EngineArgs(roofline_hardware="tpu-v9").create_engine_config()


def test_speculative_step_is_a_decode_step():
    """A decode verifying k drafts feeds 1 + k tokens: decode tokens, each attending to its own context."""
    spec = ModelSpec.from_hf_config(MODEL_PRESETS["llama-3-8b"])
    acc = StepRooflineModel(spec, get_hardware("h100-sxm"), "bf16")
    item = SimpleNamespace(num_computed_tokens=100, token_ids=list(range(5)), num_draft_tokens=4)
    rec = acc.account([item], 0.01)
    assert (rec.prefill_tokens, rec.decode_tokens, rec.phase) == (0, 5, "decode")
    attn = spec.attention_flops_per_token(1.0, "decode") * sum(range(101, 106))
    assert rec.flops == pytest.approx(2 * spec.active_params() * 5 + attn, rel=1e-12)


def test_probes_are_cached_per_machine_and_measure_refreshes(tmp_path, monkeypatch):
    """Start-up probes run once per machine: the result lands in the cache directory, a new process (an
    empty per-process table) reads it back without probing, and --roofline-hardware measure probes afresh."""
    from dataclasses import replace

    from roofline.metrics import step_roofline

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(step_roofline, "_measured", {})
    probes = []
    real = step_roofline._measure
    monkeypatch.setattr(step_roofline, "_measure", lambda d, t: probes.append(d) or real(d, t))
    first = resolve_hardware("cpu", "float32")
    assert probes == ["cpu"] and len(list((tmp_path / "roofline").glob("hardware-*.json"))) == 1
    monkeypatch.setattr(step_roofline, "_measured", {})  # as a new process
    again = resolve_hardware("cpu", "float32")
    assert probes == ["cpu"]  # read back, not probed
    assert (again.hbm_bandwidth, again.peak_flops) == (first.hbm_bandwidth, first.peak_flops) and again.measured
    monkeypatch.setattr(step_roofline, "_measure", lambda d, t: probes.append(d) or replace(first, hbm_bandwidth=1e9))
    resolve_hardware("cpu", "float32", "measure")
    assert probes == ["cpu", "cpu"]
    monkeypatch.setattr(step_roofline, "_measured", {})
    assert resolve_hardware("cpu", "float32").hbm_bandwidth == 1e9  # the fresh probe replaced the entry
