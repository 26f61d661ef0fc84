"""Llama-family variants against HF transformers on tiny random checkpoints written by `save_pretrained`:
SmolLM3 (every 4th layer attends without rope: no_rope_layers), Granite (embedding, attention and residual
multipliers, logits scaling) and OLMo 2 (post-norms, q/k norms over the whole projection: one all-reduce of
their sums of squares under tensor parallelism).  Greedy tokens identical in fp32 on the CPU under the default engine (prefix
hits), a 16-token budget, a pool small enough to preempt and tp=2; logprobs close (Granite's logits are
scaled); every block back in the pool.  The fp32 layer stack steps aside for both (it runs plain Llama)."""

from __future__ import annotations

import pytest

from roofline import LLM
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.family_parity import (
    assert_greedy_matches_hf,
    ENGINE_VARIANTS,
    GREEDY,
    assert_logprobs_close_to_hf,
    generate,
    inner_model,
    tiny_family,
    tokens,
)
from tests.reference.hf_models import build_tiny_model, hf_greedy

ARCHS = ["smollm3", "granite", "olmo2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = tiny_family(tmp_path_factory, arch)
        return made[arch]

    return get


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(models, arch, variant):
    path, prompts, reference, hf = models(arch)

    def check(llm):
        inner = inner_model(llm)
        assert inner.cpu_stack is None
        if arch == "smollm3":
            assert [layer.self_attn.use_rope for layer in inner.layers] == [True, True, True, False]

    assert_greedy_matches_hf(path, prompts, reference, variant, ENGINE_VARIANTS[variant], inspect=check)


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_close_to_hf(models, arch):
    path, prompts, _, hf = models(arch)
    assert_logprobs_close_to_hf(path, prompts, hf)


def test_sliding_window_layers_match_hf(tmp_path):
    """SmolLM3 with use_sliding_window: its sliding layers (layer_types) see their last 6 keys, as in HF; the
    prompts are longer than the window, and the tokens differ from those of the same weights without it."""
    hf = build_tiny_model("smollm3", str(tmp_path), seed=5, use_sliding_window=True, sliding_window=6,
                          max_window_layers=0)
    assert "sliding_attention" in hf.config.layer_types
    prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)
    reference = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    windows = []
    outs, _ = generate(str(tmp_path), prompts, num_kv_blocks=64, inspect=lambda llm: windows.extend(
        layer.self_attn.attn_options.sliding_window for layer in inner_model(llm).layers))
    assert tokens(outs) == reference
    assert windows == [6 if t == "sliding_attention" else None for t in hf.config.layer_types]
    hf.config.sliding_window = 10_000
    hf.config.layer_types = ["full_attention"] * len(hf.config.layer_types)
    assert [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts] != reference  # the window mattered


def test_layer_types_we_cannot_honour_are_refused(tmp_path):
    from transformers import SmolLM3Config

    from tests.reference.hf_models import TINY

    cfg = SmolLM3Config(**dict(TINY, num_hidden_layers=4))
    cfg.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    cfg.architectures = ["SmolLM3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="layer_types.*chunked_attention"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)
