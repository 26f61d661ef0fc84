"""Every engine feature leaves greedy output unchanged: prefix caching on/off, a token budget as
small as 16 (chunked prefill), the per-step ITL budget off or so tight that prompts join the decodes a
minimum chunk at a time, a pool so small that preemption happens (recompute and swap),
block sizes 1/16/32, max_num_seqs=1 versus everything together.  On CUDA too where the machine has a
GPU (against HF on the same GPU)."""

from __future__ import annotations

import random

import pytest

from roofline import LLM, SamplingParams
from tests.reference.hf_models import hf_greedy, hf_on, parity_devices

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def shared_prefix_prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(37)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        prompts.append((prefix[: rng.randint(0, 37)] if i % 2 else prefix) + tail)
    return prompts


def run(path, prompts, device="cpu", **engine_args):
    llm = LLM(path, dtype="float32", device=device, show_progress=False, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    # every block back in the pool (cached ones are free too)
    assert stats.num_free_blocks == stats.num_total_blocks
    return [o.outputs[0].token_ids for o in outs], stats


@pytest.fixture(scope="module")
def tiny(tiny_models):
    """device -> (checkpoint, prompts, HF greedy outputs on that device)."""
    path, hf_model = tiny_models["llama"]
    prompts = shared_prefix_prompts(hf_model.config.vocab_size)
    references = {}

    def get(device):
        if device not in references:
            ref_model = hf_on(hf_model, device)
            references[device] = [hf_greedy(ref_model, p, GREEDY.max_tokens) for p in prompts]
        return path, prompts, references[device]

    return get


VARIANTS = {
    "baseline": dict(num_kv_blocks=256),
    "no_prefix_caching": dict(num_kv_blocks=256, enable_prefix_caching=False),
    "budget_16": dict(num_kv_blocks=256, max_num_batched_tokens=16),
    "block_size_1": dict(num_kv_blocks=4096, block_size=1),
    "block_size_32": dict(num_kv_blocks=64, block_size=32),
    "max_num_seqs_1": dict(num_kv_blocks=256, max_num_seqs=1),
    # the other variants run as offline LLM(...) does by default, without the ITL budget (core/step_budget.py);
    # here it is on with a 2 ms target, and so tight (1 ns) that every step with decodes takes the minimum chunk
    # of prefill (3 seats and a cap of 48 tokens stagger the prompts, so that they join running decodes)
    "itl_budget_2ms": dict(num_kv_blocks=256, target_itl_ms=2),
    "itl_budget_tight": dict(num_kv_blocks=256, max_num_seqs=3, max_num_batched_tokens=48, target_itl_ms=1e-6),
    "preempt_recompute": dict(num_kv_blocks=12, block_size=8, preemption_mode="recompute"),
    "preempt_swap": dict(num_kv_blocks=12, block_size=8, preemption_mode="swap", swap_space=0.01),
}


@pytest.mark.parametrize("device", parity_devices())
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_llama_greedy_unchanged(tiny, variant, device):
    path, prompts, reference = tiny(device)
    outs, stats = run(path, prompts, device, **VARIANTS[variant])
    assert outs == reference
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0
    if variant == "baseline":
        assert stats.prefix_cache_hits > 0
    if variant == "itl_budget_tight":
        from roofline.core.step_budget import MIN_CHUNK_TOKENS

        mixed = [r for r in stats.step_roofline if r.decode_tokens and r.prefill_tokens]
        assert mixed and all(r.prefill_tokens <= MIN_CHUNK_TOKENS for r in mixed)
        assert all(r.token_budget == r.decode_tokens + MIN_CHUNK_TOKENS for r in mixed)


@pytest.mark.parametrize("device", parity_devices())
def test_smollm2_features_unchanged(device, smollm2_on):
    """The real model: caching off + budget 16 + block size 32, and a tiny pool that preempts (swap)."""
    default_llm = smollm2_on(device)
    tok = default_llm.get_tokenizer()
    system = "You are a careful assistant. Answer briefly and precisely. "
    questions = ["Name a red fruit.", "What is 2+2?", "Give me a color.", "Say hello in French.", "Name a planet."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "system", "content": system},
                                                   {"role": "user", "content": q}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for q in questions]
    base = [o.outputs[0].token_ids for o in default_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]
    a, _ = run(None, prompts, device, num_kv_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=16,
               block_size=32)
    assert a == base
    b, stats = run(None, prompts, device, num_kv_blocks=12, block_size=16, preemption_mode="swap", swap_space=0.05,
                   max_model_len=512)
    assert stats.num_preemptions > 0
    assert b == base
