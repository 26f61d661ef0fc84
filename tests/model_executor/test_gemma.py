"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random checkpoints written by `save_pretrained`:
sliding-window layers (6 keys, shorter than every prompt) beside global ones, Gemma 2's attention and final
logit soft-caps, Gemma 3's q/k norms and per-layer-type rope (a local base; a global base with linear
scaling), (1 + w) norms, scaled embeddings, GeGLU.  Greedy tokens identical in fp32 on the CPU under the
default engine (prefix hits), a 16-token budget, a pool small enough to preempt (recompute and swap) and tp=2,
on the native CPU backend and the torch reference, with the sliding layers' blocks given back as they leave
the window (the hybrid KV layout) and with every block kept; logprobs close (the final soft-cap shows there);
every block back in the pool.  The same KV memory holds a longer request with the windows counted."""

from __future__ import annotations

import pytest

from roofline import LLM
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.family_parity import (
    assert_greedy_matches_hf,
    ENGINE_VARIANTS,
    assert_logprobs_close_to_hf,
    inner_model,
    tiny_family,
)
from tests.reference.hf_models import build_tiny_model, hf_greedy

ARCHS = ["gemma2", "gemma3"]
VARIANTS = dict(ENGINE_VARIANTS, torch_backend=dict(num_kv_blocks=64, attention_backend="torch"),
                every_block_kept=dict(num_kv_blocks=64, hybrid_kv_cache=False))
for _name in ("preempt_recompute", "preempt_swap"):  # the windows' blocks go back: half the pool still preempts
    VARIANTS[_name] = dict(VARIANTS[_name], num_kv_blocks=6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = tiny_family(tmp_path_factory, arch)
            prompts, hf = made[arch][1], made[arch][3]
            assert min(map(len, prompts)) > 2 * hf.config.sliding_window
        return made[arch]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(models, arch, variant):
    path, prompts, reference, hf = models(arch)

    def check(llm):
        inner = inner_model(llm)
        assert inner.cpu_stack is None  # the fp32 layer stack runs plain Llama layers only
        assert [layer.self_attn.attn_options.sliding_window for layer in inner.layers] == [
            6 if t == "sliding_attention" else None for t in hf.config.layer_types]
        tables = {layer.self_attn.rotary.cos_cache.data_ptr() for layer in inner.layers}
        assert len(tables) == {"gemma2": 1, "gemma3": 2}[arch]  # one rope table per distinct rope, shared by layers
        kv = llm.llm_engine.scheduler.kv  # sliding layers in their own block tables (gemma2: 2 groups of 2 layers)
        assert sorted(kv.group_windows) == {"gemma2": [0, 6], "gemma3": [0, 6, 6, 6]}[arch]

    assert_greedy_matches_hf(path, prompts, reference, variant, VARIANTS[variant], inspect=check)


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_close_to_hf(models, arch):
    path, prompts, _, hf = models(arch)
    assert_logprobs_close_to_hf(path, prompts, hf)  # Gemma 2's final soft-cap shows here


def test_the_window_and_the_soft_cap_change_the_tokens(tmp_path):
    """The checkpoints above are ones where the mechanisms matter: the same weights without the window, or
    without Gemma 2's attention soft-cap, greedy-decode other tokens in HF."""
    prompts = None
    for arch, override in (("gemma2", dict(sliding_window=10_000)), ("gemma2", dict(attn_logit_softcapping=None)),
                           ("gemma3", dict(sliding_window=10_000))):
        base = build_tiny_model(arch, str(tmp_path / f"{arch}-a"), seed=5)
        other = build_tiny_model(arch, str(tmp_path / f"{arch}-b"), seed=5, **override)
        prompts = shared_prefix_prompts(base.config.vocab_size, n=4, seed=4)
        assert [hf_greedy(base, p, 12) for p in prompts] != [hf_greedy(other, p, 12) for p in prompts], (arch, override)


@pytest.mark.parametrize("field,value,match", [
    ("layer_types", ["sliding_attention", "chunked_attention", "full_attention", "full_attention"],
     "layer_types.*chunked_attention"),
    ("hidden_activation", "relu", "hidden_activation"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_config_fields_we_cannot_honour_are_named(tmp_path, field, value, match):
    from tests.reference.hf_models import tiny_config

    cfg = tiny_config("gemma3")
    setattr(cfg, field, value)
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(Exception, match=match):
        LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=8, show_progress=False)


def test_the_windows_lengthen_what_the_same_memory_holds(models):
    """4 of gemma3's layers: 3 slide (6 keys), 1 does not; with 1 MiB of KV the hybrid layout holds a
    request about 4x as long as keeping every layer's blocks does."""
    path = models("gemma3")[0]
    capacity = {}
    for hybrid in (True, False):
        llm = LLM(path, dtype="float32", device="cpu", show_progress=False, kv_cache_memory=1 << 20,
                  hybrid_kv_cache=hybrid)
        capacity[hybrid] = llm.llm_engine.kv_capacity_tokens
        llm.llm_engine.shutdown()
    assert capacity[True] > 3.5 * capacity[False], capacity
