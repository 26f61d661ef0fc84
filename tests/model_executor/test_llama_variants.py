"""Llama-family variants against HF transformers on tiny random checkpoints written by `save_pretrained`:
SmolLM3 (every 4th layer attends without rope: no_rope_layers), Granite (embedding, attention and residual
multipliers, logits scaling) and OLMo 2 (post-norms, q/k norms over the whole projection: one all-reduce of
their sums of squares under tensor parallelism).  Greedy tokens identical in fp32 on the CPU under the default engine (prefix
hits), a 16-token budget, a pool small enough to preempt and tp=2; logprobs close (Granite's logits are
scaled); every block back in the pool.  The fp32 layer stack steps aside for both (it runs plain Llama)."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.test_deepseek import VARIANTS
from tests.reference.hf_models import build_tiny_model, hf_greedy, hf_logprobs

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ARCHS = ["smollm3", "granite", "olmo2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            hf = build_tiny_model(arch, path, seed=5)
            prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)
            made[arch] = (path, prompts, [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts], hf)
        return made[arch]

    return get


def generate(path, prompts, sampling=GREEDY, **engine_args):
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return outs, stats, llm


@pytest.mark.parametrize("variant", list(VARIANTS) + ["tp2"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(models, arch, variant):
    path, prompts, reference, hf = models(arch)
    args = dict(num_kv_blocks=64, tensor_parallel_size=2) if variant == "tp2" else VARIANTS[variant]
    outs, stats, llm = generate(path, prompts, **args)
    assert [o.outputs[0].token_ids for o in outs] == reference
    if variant == "default":
        assert stats.prefix_cache_hits > 0
        inner = llm.llm_engine.executor.worker.model.model
        assert inner.cpu_stack is None
        if arch == "smollm3":
            assert [layer.self_attn.use_rope for layer in inner.layers] == [True, True, True, False]
    if variant.startswith("preempt"):
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_close_to_hf(models, arch):
    path, prompts, reference, hf = models(arch)
    sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs, _, _ = generate(path, prompts[:2], sampling, num_kv_blocks=64)
    for p, o in zip(prompts[:2], outs):
        tokens = o.outputs[0].token_ids
        want = hf_logprobs(hf, p + tokens)[len(p) - 1:-1]  # [T, V] log-softmax at each generated position
        got = torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(got, want[torch.arange(len(tokens)), torch.tensor(tokens)], atol=1e-4, rtol=1e-4)


def test_sliding_window_layers_are_refused(tmp_path):
    from transformers import SmolLM3Config

    from tests.reference.hf_models import TINY

    cfg = SmolLM3Config(**dict(TINY, num_hidden_layers=4, use_sliding_window=True, sliding_window=8))
    cfg.architectures = ["SmolLM3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="layer_types"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)
