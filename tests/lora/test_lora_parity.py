"""Mixed batches of two adapters (ranks 8 and 4, rsLoRA on one) and the base model give PEFT's greedy tokens
(fp32, CPU) on a tiny Llama and a tiny Qwen3 -- plain, under chunked prefill, under preemption, at tp=2 and with
one adapter slot, with the native shrink/expand kernel and with torch's -- and on tiny Phi-3 (fused projections in
HF too), Gemma 2 and OLMo 2; every KV block comes back."""

from __future__ import annotations

import pytest

from roofline import SamplingParams
from tests.lora.conftest import MAX_TOKENS, MIX
from tests.model_executor.family_parity import generate, inner_model, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
VARIANTS = {
    "default": dict(num_kv_blocks=128),
    "budget_16": dict(num_kv_blocks=128, max_num_batched_tokens=16),
    "preempt_recompute": dict(num_kv_blocks=12, block_size=8, preemption_mode="recompute"),
    "one_slot": dict(num_kv_blocks=128, max_loras=1),
    "tp2": dict(num_kv_blocks=64, tensor_parallel_size=2),
    "torch_ops": dict(num_kv_blocks=128, cpu_kernels=False),  # the torch shrink/expand (lora/ops.py)
}
CASES = ([("llama", v) for v in VARIANTS] + [("qwen3", v) for v in ("default", "budget_16", "preempt_recompute")]
         + [("phi3", "default")]  # Phi-3: adapters on HF's fused qkv_proj / gate_up_proj
         + [("gemma2", "default"), ("olmo2", "default")])


@pytest.mark.parametrize("arch,variant", CASES)
def test_mixed_batch_matches_peft(lora_family, arch, variant):
    fam = lora_family(arch)
    seen = {}

    def inspect(llm):
        if variant == "default" and arch in ("llama", "qwen3"):  # the CPU layer stack is there (adapter steps run in it)
            seen["stack"] = inner_model(llm).cpu_stack is not None

    outs, stats = generate(fam.path, fam.prompts, GREEDY, inspect=inspect, lora_request=fam.lora_requests(),
                           **dict(LORA, **VARIANTS[variant]))
    assert tokens(outs) == fam.expected
    if variant == "preempt_recompute":
        assert stats.num_preemptions > 0
    if variant == "default" and arch in ("llama", "qwen3"):
        assert seen["stack"]


def test_adapters_change_the_output(lora_family):
    """The references differ: each adapter's continuation of a prompt is its own."""
    fam = lora_family("llama")
    p = fam.prompts[0]
    from tests.reference.hf_models import hf_greedy

    runs = {tuple(hf_greedy(ref, p, MAX_TOKENS)) for ref in fam.refs}
    assert len(runs) == 3
    assert len({MIX[i] for i in range(len(MIX))}) == 3


def test_the_reference_is_peft(lora_family):
    """The references above against the real thing: peft's PeftModel loading the same adapter directories gives
    the same greedy tokens (a1: rank 8 on every projection; a2: rank 4 with rsLoRA)."""
    import copy

    from peft import PeftModel

    from tests.reference.hf_models import hf_greedy

    fam = lora_family("llama")
    for k in (1, 2):
        model = PeftModel.from_pretrained(copy.deepcopy(fam.refs[0]), fam.loras[k].lora_path).eval()
        for p, m, want in zip(fam.prompts, MIX, fam.expected):
            if m == k:
                assert hf_greedy(model, p, MAX_TOKENS) == want
