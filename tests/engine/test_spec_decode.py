"""Speculative decoding end to end: greedy output identical to HF and to speculation off under prompt
lookup (ngram) and under a draft model (equal to the target: everything accepted; a tiny random one with
the same vocabulary: almost nothing accepted), in the default, chunked (budget 16) and tiny-pool
(preemption, both modes) settings, with n > 1 and priority scheduling, every KV block back in the pool
after each run; the target's logprobs; seeded random sampling reproducible; bad speculative_config
values named at start-up."""

from __future__ import annotations

import random
import re

import pytest

from roofline import LLM, SamplingParams
from roofline.sampling_params import StructuredOutputsParams
from tests.reference.hf_models import hf_greedy, hf_greedy_given

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# adaptive off: the tiny model is overhead-bound, the roofline would pick few drafts; here every step verifies
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def repetitive_prompts(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat spans (so prompt lookup finds matches), of different lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        span = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))]
        prompts.append([rng.randrange(3, vocab) for _ in range(i)] + span * rng.randint(2, 4))
    return prompts


def run(path, prompts, params=GREEDY, **engine_args):
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # every block back in the pool
    return outs, stats, llm


@pytest.fixture(scope="module")
def tiny(tiny_models):
    path, hf_model = tiny_models["llama"]
    prompts = repetitive_prompts(hf_model.config.vocab_size)
    reference = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    return path, prompts, reference


VARIANTS = {
    "default": dict(num_kv_blocks=256),
    "budget_16": dict(num_kv_blocks=256, max_num_batched_tokens=16),
    "preempt_recompute": dict(num_kv_blocks=14, block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(num_kv_blocks=14, block_size=8, preemption_mode="swap", swap_space=0.01),
    "priority_no_caching": dict(num_kv_blocks=256, scheduling_policy="priority", enable_prefix_caching=False),
    # the per-step ITL budget so tight that prompts join the verifying decodes a minimum chunk at a time
    "itl_budget_tight": dict(num_kv_blocks=256, max_num_seqs=3, max_num_batched_tokens=48, target_itl_ms=1e-6),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ngram_greedy_matches_hf_and_speculation_off(tiny, variant):
    path, prompts, reference = tiny
    args = VARIANTS[variant]
    outs, stats, _ = run(path, prompts, speculative_config=NGRAM, **args)
    assert [o.outputs[0].token_ids for o in outs] == reference
    off, _, _ = run(path, prompts, **args)
    assert [o.outputs[0].token_ids for o in off] == reference
    spec = stats.spec_decode
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0


def test_adaptive_draft_length_and_itl_budget_share_one_estimate(tiny):
    """The adaptive draft length and the ITL budget plan with the engine's one step-time estimate; greedy output
    unchanged; each step's record carries the draft length, the budget and the predicted time."""
    path, prompts, reference = tiny
    outs, stats, llm = run(path, prompts, speculative_config={**NGRAM, "adaptive": True}, num_kv_blocks=256,
                           max_num_seqs=3, max_num_batched_tokens=48, target_itl_ms=1e-6)
    assert [o.outputs[0].token_ids for o in outs] == reference
    core = llm.llm_engine
    assert core.scheduler.draft_length_policy.step_time is core.step_time is core.scheduler.step_budget.step_time
    records = stats.step_roofline
    assert records and all(0 <= r.draft_length <= 4 and r.predicted_s > 0 for r in records)
    assert any(r.token_budget and r.decode_tokens and r.prefill_tokens for r in records)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A tiny random Llama with the target's vocabulary (384), 1 layer, other weights."""
    from tests.reference.hf_models import build_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-draft"))
    build_tiny_model("llama", path, seed=7, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    return path


DRAFT_VARIANTS = {k: VARIANTS[k] for k in ("default", "budget_16", "preempt_recompute", "preempt_swap")}


@pytest.mark.parametrize("variant", list(DRAFT_VARIANTS))
@pytest.mark.parametrize("draft", ["same_as_target", "tiny_random"])
def test_draft_model_greedy_matches_hf(tiny, tiny_draft, variant, draft):
    path, prompts, reference = tiny
    draft_path = path if draft == "same_as_target" else tiny_draft
    config = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": 3, "adaptive": False}
    outs, stats, _ = run(path, prompts, speculative_config=config, **DRAFT_VARIANTS[variant])
    assert [o.outputs[0].token_ids for o in outs] == reference
    spec = stats.spec_decode
    assert spec.num_draft_tokens > 0
    if draft == "same_as_target":
        assert spec.num_accepted_tokens == spec.num_draft_tokens  # the target's own guesses
    else:
        assert spec.acceptance_rate < 0.3
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0


def test_draft_model_random_sampling_same_target_accepts_most(tiny):
    """A draft equal to the target proposes from q = p: min(1, p/q) = 1, every draft is accepted."""
    path, prompts, _ = tiny
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=16, ignore_eos=True)
    config = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "adaptive": False}
    a, stats, _ = run(path, prompts[:3], sp, num_kv_blocks=256, speculative_config=config)
    b, _, _ = run(path, prompts[:3], sp, num_kv_blocks=256, speculative_config=config)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert stats.spec_decode.acceptance_rate > 0.95


def test_draft_with_another_vocabulary_is_refused(tiny, tmp_path):
    from tests.reference.hf_models import build_tiny_model

    path, _, _ = tiny
    build_tiny_model("llama", str(tmp_path), seed=2, vocab_size=500)
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary \(500"):
        LLM(path, dtype="float32", device="cpu", num_kv_blocks=16, show_progress=False,
            speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})


def test_ngram_with_n_siblings_and_random_sampling_reproducible(tiny):
    path, prompts, _ = tiny
    sp = SamplingParams(n=3, temperature=0.8, top_k=20, seed=42, max_tokens=20, ignore_eos=True)
    a, stats, _ = run(path, prompts[:3], sp, num_kv_blocks=256, speculative_config=NGRAM)
    b, _, _ = run(path, prompts[:3], sp, num_kv_blocks=256, speculative_config=NGRAM)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.token_ids) == 20 for o in a for c in o.outputs)
    assert stats.spec_decode.num_draft_tokens > 0


def test_smollm2_input_grounded_greedy_and_logprobs(default_llm, hf_default_model):
    """W7's kind of prompt on the real model: long accepted runs, tokens equal to HF and to speculation
    off, logprobs the target model's (equal to speculation off's within 1e-4)."""
    import inspect
    import json

    tok = default_llm.get_tokenizer()
    doc = inspect.getsource(json)[:600]
    ids = tok.encode(doc + "\n\n" + doc + "\n\n" + doc[:120], add_special_tokens=False)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    off = default_llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    # adaptive off: the policy's choice rests on measured step times, which a loaded machine moves
    llm = LLM(dtype="float32", device="cpu", num_kv_blocks=256, show_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 5, "adaptive": False})
    on = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
    assert on.token_ids == off.token_ids == hf_greedy_given(hf_default_model, ids, off.token_ids)
    for a, b in zip(on.logprobs, off.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.spec_decode.acceptance_rate > 0.5 and stats.spec_decode.mean_acceptance_length > 2


@pytest.mark.parametrize("config, field", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}, "bogus"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "speculative_config.model"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "speculative_config.method 'mtp' needs a DeepSeek-V3"),
])
def test_bad_speculative_config_names_the_field(config, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LLM(dtype="float32", device="cpu", num_kv_blocks=16, show_progress=False, speculative_config=config)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp3_greedy_matches_tp1(default_llm, method, tmp_path):
    """SmolLM2 split over 3 ranks (gloo): every rank verifies and proposes the same drafts (prompt lookup,
    or a tiny random draft model with SmolLM2's vocabulary split over the same ranks); tokens equal to
    tp=1 without speculation (a flip only at a proven tie), blocks all back.  With prompt lookup, grammar-
    constrained rows run beside a speculating one and match their regex."""
    import inspect
    import textwrap

    from tests.executor.tp_helpers import assert_same_greedy

    tok = default_llm.get_tokenizer()
    doc = inspect.getsource(textwrap)[:500]
    prompts = [{"prompt_token_ids": tok.encode(doc + "\n\n" + doc[:100], add_special_tokens=False)},
               {"prompt_token_ids": tok.encode("List three prime numbers.", add_special_tokens=False)}]
    # 12 tokens: a step here is 3 ranks over gloo on a shared CPU (about 0.2 s on two cores)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = default_llm.generate(prompts, sp, use_tqdm=False)
    config = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model":
        from tests.reference.hf_models import build_tiny_model

        build_tiny_model("llama", str(tmp_path), seed=5, vocab_size=49152, hidden_size=48, num_attention_heads=3,
                         num_key_value_heads=3, num_hidden_layers=1, intermediate_size=96, head_dim=16,
                         max_position_embeddings=8192)
        config["model"] = str(tmp_path)
    llm = LLM(tensor_parallel_size=3, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False,
              speculative_config=config)
    try:
        assert_same_greedy(ref, llm.generate(prompts, sp, use_tqdm=False))
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.spec_decode.num_draft_tokens > 0
        if method == "ngram":
            assert stats.spec_decode.num_accepted_tokens > 0
            # grammar-constrained rows (never speculated) beside speculating ones: the step's bitmask
            # reaches every TP rank inside the SchedulerOutput
            regex = "[A-Z][a-z]{1,8} [0-9]{2}"
            constrained = SamplingParams(temperature=0, max_tokens=16,
                                         structured_outputs=StructuredOutputsParams(regex=regex))
            outs = llm.generate(prompts + prompts[1:], [sp, constrained, constrained], use_tqdm=False)
            assert_same_greedy(ref[:1], outs[:1])
            texts = [o.outputs[0].text for o in outs[1:]]
            assert all(re.fullmatch(regex, t) for t in texts), texts
            stats = llm.llm_engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.llm_engine.shutdown()


def test_served_engine_core_process_speculates_and_reports(tiny):
    """The server's path: AsyncLLM over an engine core in its own process; same tokens as HF, and the
    speculative counters come back with the core's stats."""
    import asyncio
    import time

    from roofline.config import EngineArgs
    from roofline.engine.async_llm import AsyncLLM

    path, prompts, reference = tiny
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, device="cpu", dtype="float32", num_kv_blocks=128,
                                                  engine_core_process=True, speculative_config=NGRAM))

    async def one(i, p):
        last = None
        async for out in engine.generate(p, GREEDY, f"r{i}"):
            last = out
        return last

    async def all_of_them():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        outs = asyncio.run(all_of_them())
        assert [o.outputs[0].token_ids for o in outs] == reference
        deadline = time.monotonic() + 10
        while True:
            stats = engine.get_stats()
            if (stats.num_running == 0 and stats.spec_decode is not None) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.spec_decode.num_accepted_tokens > 0
    finally:
        engine.shutdown()
