"""The offline LLM class's defaults against the engine's (roofline/engine/llm.py): the ITL-driven token budget
(core/step_budget.py) is off in LLM(...) unless a target is given, on by default in EngineCore (the server's
engine); a step of a burst then takes the whole max_num_batched_tokens offline."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams
from roofline.config import EngineArgs
from roofline.engine.engine_core import EngineCore


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.reference.hf_models import build_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-llama-defaults"))
    build_tiny_model("llama", path, seed=0)
    return path


def test_offline_llm_runs_without_the_itl_budget_unless_given_a_target(tiny):
    llm = LLM(tiny, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    core = llm.llm_engine
    assert core.config.scheduler_config.target_itl_ms == 0 and core.scheduler.step_budget is None
    given = LLM(tiny, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False, target_itl_ms=30)
    budget = given.llm_engine.scheduler.step_budget
    assert budget is not None and budget.target_s == pytest.approx(0.030)


def test_the_engine_keeps_the_itl_budget_on_by_default(tiny):
    core = EngineCore.from_engine_args(EngineArgs(model=tiny, dtype="float32", device="cpu", num_kv_blocks=64),
                                       show_progress=False)
    budget = core.scheduler.step_budget
    assert budget is not None and budget.target_s is None  # the default: a multiple of the batch's decode step


def test_offline_burst_takes_the_whole_cap_beside_its_decodes(tiny):
    """Eight prompts of 24 tokens under a 32-token cap: every step fills the cap (decodes first, then prefill)
    while prompts wait, as without any budget; the same tokens as with the budget on."""
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(24)]} for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False, max_num_batched_tokens=32,
              enable_prefix_caching=False)
    llm.llm_engine.get_stats()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    records = llm.llm_engine.get_stats().step_roofline
    total_prompt = 8 * 24
    filled = [r for r in records if r.prefill_tokens]
    assert sum(r.prefill_tokens for r in filled) == total_prompt
    assert all(r.prefill_tokens + r.decode_tokens == 32 for r in filled[:-1])  # the last one takes what is left
    on = LLM(tiny, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False, max_num_batched_tokens=32,
             enable_prefix_caching=False, target_itl_ms=1e-6)
    assert [o.outputs[0].token_ids for o in on.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]
