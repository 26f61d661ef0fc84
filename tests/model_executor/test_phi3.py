"""Phi-3 (Phi3ForCausalLM) against HF transformers on a tiny random checkpoint written by `save_pretrained`:
fused qkv_proj / gate_up_proj tensors cut into their shards at load, LongRoPE with its attention factor,
partial rope (Phi-4-mini's partial_rotary_factor).  Greedy tokens identical in fp32 on the CPU under the
default engine (prefix hits, through the fp32 layer stack), a 16-token budget, a pool small enough to preempt
and tp=2 (the modules); logprobs close; every block back in the pool.  The LongRoPE tables against HF's own
rotary embedding for both factor sets, a sliding window (Phi-3-mini-4k's), and bad rope configs failing at
start-up with the field named.

LongRoPE's choice is unambiguous here: max_position_embeddings (512) > original_max_position_embeddings
(16), so the engine uses the long factors, and every prompt is longer than 16 tokens, so HF does too."""

from __future__ import annotations

import pytest
import torch

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
from tests.reference.hf_models import (
    PHI3_ORIGINAL_MAX_POSITIONS,
    build_tiny_model,
    hf_greedy,
    phi3_longrope,
    tiny_config,
)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(checkpoint, prompts sharing a prefix, HF greedy outputs, HF model)."""
    made = tiny_family(tmp_path_factory, "phi3")
    assert min(map(len, made[1])) > PHI3_ORIGINAL_MAX_POSITIONS  # HF takes the long factors throughout
    return made


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_hf(phi3, variant):
    path, prompts, reference, _ = phi3

    def check(llm):
        from roofline.cpu import ops as cpu_ops

        inner = inner_model(llm)
        assert [layer.self_attn.rotary.rotary_dim for layer in inner.layers] == [12, 12]  # 16 x 0.75
        assert (inner.cpu_stack is not None) == cpu_ops.available()  # a plain Llama layer: the stack runs it

    assert_greedy_matches_hf(path, prompts, reference, variant, ENGINE_VARIANTS[variant], inspect=check)


def test_logprobs_close_to_hf(phi3):
    path, prompts, _, hf = phi3
    assert_logprobs_close_to_hf(path, prompts, hf)


def test_sliding_window_matches_hf(tmp_path):
    """Phi-3-mini-4k's one window for every layer (2047 there, 24 here: shorter than every prompt)."""
    hf = build_tiny_model("phi3", str(tmp_path), seed=5, sliding_window=24)
    prompts = shared_prefix_prompts(hf.config.vocab_size, n=4, seed=4)
    windows = set()
    outs, _ = generate(str(tmp_path), prompts, num_kv_blocks=64, max_num_batched_tokens=16, inspect=lambda llm: windows.update(
        layer.self_attn.attn_options.sliding_window for layer in inner_model(llm).layers))
    assert tokens(outs) == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    assert windows == {24}


def _rotary(cfg):
    """The rope of layer 0 of our Phi-3 built from cfg (what the engine builds at start-up)."""
    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.model_executor.models.phi3 import Phi3ForCausalLM

    return Phi3ForCausalLM(cfg, TorchAttentionBackend()).model.layers[0].self_attn.rotary


@pytest.mark.parametrize("which", ["long", "short"])
def test_longrope_tables_match_hf(which):
    """cos/sin for every position against HF's Phi3RotaryEmbedding given all positions at once: the long
    factors with the default attention factor (512 > 16 positions), the short ones with an explicit one
    (a model whose max_position_embeddings is its original window)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    if which == "long":
        cfg, attention_factor = tiny_config("phi3"), 1.5  # sqrt(1 + ln(512 / 16) / ln(16))
    else:
        cfg = tiny_config("phi3", max_position_embeddings=64, original_max_position_embeddings=64,
                          rope_parameters=phi3_longrope(attention_factor=1.2))
        attention_factor = 1.2
    ours = _rotary(cfg)
    hf = Phi3RotaryEmbedding(cfg)
    positions = torch.arange(cfg.max_position_embeddings)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    assert hf.attention_scaling == pytest.approx(attention_factor)
    factors = torch.tensor(cfg.rope_parameters[f"{which}_factor"])
    assert torch.equal(hf.inv_freq, 1.0 / (factors * 10000.0 ** (torch.arange(0, 12, 2).float() / 12)))
    torch.testing.assert_close(ours.cos_cache, cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin_cache, sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("field, change", [
    ("rope_type", lambda cfg: cfg.rope_parameters.update(rope_type="proportional")),
    ("long_factor", lambda cfg: cfg.rope_parameters.update(long_factor=[1.0] * 8)),
    ("short_factor", lambda cfg: cfg.rope_parameters.pop("short_factor")),
])
def test_bad_config_fails_at_start_up(field, change):
    cfg = tiny_config("phi3")
    change(cfg)
    with pytest.raises(ValueError, match=field), torch.device("meta"):
        _rotary(cfg)


def test_fused_fp8_tensor_splits_on_any_row():
    """A fused FP8 block tensor cut inside a block of rows: each part dequantizes to its rows of the whole."""
    from roofline.model_executor.layers.quantization.fp8 import Fp8BlockTensor, quantize_fp8_blocks
    from roofline.model_executor.models.phi3 import split_rows

    w = torch.randn(40, 32)
    fused = Fp8BlockTensor(*quantize_fp8_blocks(w, (16, 16)), 16, 16)
    parts = split_rows(fused, [24, 8, 8])
    assert all(isinstance(p, Fp8BlockTensor) for p in parts)
    torch.testing.assert_close(torch.cat([p.dequantize() for p in parts]), fused.dequantize(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="rows"):
        split_rows(w, [24, 8])
