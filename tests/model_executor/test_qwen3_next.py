"""Qwen3-Next (Qwen3NextForCausalLM) against HF transformers on a tiny random checkpoint written by `save_pretrained`:
3 Gated DeltaNet (linear-attention) layers, then a gated full-attention layer with partial rotary; 4 experts top-2
with a sigmoid-gated shared expert, layer 1 dense (mlp_only_layers).  Greedy tokens identical in fp32 on the CPU
under the default engine, a 16-token budget (every prompt is longer: the recurrent state advances chunk by chunk,
and decodes share steps with prefill chunks), a pool small enough to preempt (recompute), two state slots for four
requests, and tp=2 (1 key head group and 2 value heads per rank); logprobs close; every KV block and every state
slot back.  Prefix caching is off for this model: a repeated prompt gives the same tokens and no hits.  Swap
preemption and speculative decoding are start-up errors naming the reason."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams
from tests.model_executor.family_parity import (
    GREEDY,
    assert_logprobs_close_to_hf,
    inner_model,
    tiny_family,
    tokens,
)
from tests.reference.hf_models import build_tiny_model, hf_greedy

VARIANTS = {
    "default": dict(num_kv_blocks=128),
    "budget_16": dict(num_kv_blocks=128, max_num_batched_tokens=16),
    "preempt_recompute": dict(num_kv_blocks=12, block_size=8, preemption_mode="recompute"),
    "two_state_slots": dict(num_kv_blocks=128, max_num_seqs=2),
    "tp2": dict(num_kv_blocks=64, tensor_parallel_size=2),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path, prompts, reference, hf = tiny_family(tmp_path_factory, "qwen3_next")
    assert min(map(len, prompts)) > 16  # a 16-token budget splits every prompt
    return path, prompts, reference, hf


def every_state_slot_back(llm) -> None:
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_state_slots == llm.llm_engine.config.scheduler_config.max_num_seqs
    assert kv.num_free_state_slots == kv.num_state_slots and not kv.req_state_slot


def recording_steps(llm) -> list[list[int]]:
    """Observe the one-rank engine's steps: per step its requests' row counts (the real runner still runs them)."""
    runner = llm.llm_engine.executor.worker.runner
    seen, execute = [], runner.execute

    def recording(out, *a, **kw):
        seen.append(sorted(len(s.token_ids) for s in out.scheduled))
        return execute(out, *a, **kw)

    runner.execute = recording
    return seen


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(model, variant):
    """Every variant: HF's tokens, every block and state slot back, no prefix hits.  The default engine also
    computes a repeated prompt again with the same tokens (prefix caching is off for this model: no hits) and
    n = 2 siblings that compute their prompt each (a fork cannot share the parent's state, which is past the
    prompt); under the 16-token budget, steps carry decode rows beside another request's prefill chunk."""
    path, prompts, reference, _ = model
    args = VARIANTS[variant]
    tp = args.get("tensor_parallel_size", 1)
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **args)
    try:
        seen = recording_steps(llm) if tp == 1 else None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert tokens(outs) == reference
        if variant == "budget_16":
            assert any(lens[0] == 1 and lens[-1] > 1 for lens in seen), seen
        if variant == "default":
            assert llm.llm_engine.config.cache_config.enable_prefix_caching is False
            again = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
            assert tokens(again) == reference[:1]
            forks = llm.generate([{"prompt_token_ids": prompts[1]}],
                                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2), use_tqdm=False)
            assert [c.token_ids for c in forks[0].outputs] == [reference[1]] * 2
        if tp == 1:
            assert [layer.layer_type for layer in inner_model(llm).layers] == ["linear_attention"] * 3 + ["full_attention"]
            specs = llm.llm_engine.executor.worker.model.kv_cache_specs()
            assert [s.kind for s in specs] == ["recurrent"] * 3 + ["attention"]
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks  # every KV block back
        every_state_slot_back(llm)
        assert stats.prefix_cache_hits == 0
        if variant.startswith("preempt"):
            assert stats.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()


def test_logprobs_close_to_hf(model):
    path, prompts, _, hf = model
    assert_logprobs_close_to_hf(path, prompts, hf)


def test_every_layer_kind_and_the_experts_matter(tmp_path, model):
    """The checkpoint is one where the mechanisms matter: with full attention in place of the linear layers, or
    with dense MLPs only, HF greedy-decodes other tokens."""
    _, prompts, reference, _ = model
    for override in (dict(layer_types=["full_attention"] * 4), dict(mlp_only_layers=[0, 1, 2, 3])):
        other = build_tiny_model("qwen3_next", str(tmp_path / str(len(override))), seed=5, **override)
        assert [hf_greedy(other, p, 12) for p in prompts[:2]] != reference[:2], override


@pytest.mark.parametrize("engine_args,match", [
    (dict(preemption_mode="swap", swap_space=0.01), "preemption_mode 'swap'"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                              "prompt_lookup_max": 2}), "speculative decoding"),
])
def test_what_cannot_work_with_recurrent_state_is_refused(model, engine_args, match):
    with pytest.raises(ValueError, match=match):
        LLM(model[0], dtype="float32", device="cpu", show_progress=False, num_kv_blocks=16, **engine_args)


def test_unknown_layer_type_is_named(tmp_path):
    from tests.reference.hf_models import tiny_config

    cfg = tiny_config("qwen3_next")
    cfg.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    cfg.architectures = ["Qwen3NextForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="layer_types.*sliding_attention"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)


def test_state_slots_come_out_of_the_kv_budget(model):
    """The pool's blocks are what the KV memory holds after max_num_seqs recurrent states; states that leave no
    room are a start-up error."""
    path = model[0]
    from roofline.attention import kv_spec

    blocks = {}
    for seqs in (4, 32):
        llm = LLM(path, dtype="float32", device="cpu", show_progress=False, kv_cache_memory=1 << 20, max_num_seqs=seqs)
        try:
            worker = llm.llm_engine.executor.worker
            specs = worker.model.kv_cache_specs()
            per_state = kv_spec.state_bytes(specs, 1)
            assert per_state == 3 * (128 * 3 + 4 * 16 * 16) * 4  # 3 linear layers: conv (128 ch x 3) + 4 x 16 x 16
            assert blocks.setdefault(seqs, worker.num_blocks) == ((1 << 20) - seqs * per_state) // worker.block_bytes()
        finally:
            llm.llm_engine.shutdown()
    assert blocks[32] < blocks[4]
    with pytest.raises(ValueError, match="recurrent states of max_num_seqs=64"):  # 64 x 16.5 KiB > 1 MiB
        LLM(path, dtype="float32", device="cpu", show_progress=False, kv_cache_memory=1 << 20, max_num_seqs=64)
