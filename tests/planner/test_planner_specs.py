"""Model specs (presets and HF config directories), hardware presets and the cost model's structure."""

import json
import math

import pytest

from roofline.planner.cost_model import PlanInputs, decode_at, make_plan, prefill, saturation_batch
from roofline.planner.hardware import GPU_PRESETS, GiB, get_hardware, normalize_dtype
from roofline.planner.model_specs import MODEL_PRESETS, ModelSpec, load_model_spec

PUBLISHED_PARAMS = {
    "llama-2-7b": 6.74e9,
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.55e9,
    "qwen3-8b": 8.19e9,
    "deepseek-v3": 671e9,
    "smollm2-135m": 134.5e6,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_param_counts(name):
    spec = load_model_spec(name)
    assert spec.total_params() == pytest.approx(PUBLISHED_PARAMS[name], rel=0.005)


def test_presets_cover_issue_list():
    for name in ("llama-2-7b", "llama-3-8b", "llama-3-70b", "qwen3-8b", "deepseek-v3"):
        assert name in MODEL_PRESETS
    for name in ("h100-sxm", "h200", "a100-80gb", "l4"):
        assert name in GPU_PRESETS
    assert get_hardware("H100").name == "h100-sxm"
    assert get_hardware("cpu").name == "cpu"
    with pytest.raises(ValueError):
        get_hardware("tpu-v5")
    with pytest.raises(ValueError):
        load_model_spec("no-such-model")


def test_gqa_kv_bytes_and_tp_split():
    spec = load_model_spec("llama-3-8b")  # 32 layers, 8 KV heads x 128
    assert spec.kv_bytes_per_token(2) == 32 * 2 * 8 * 128 * 2 == 131072
    assert spec.kv_bytes_per_token(2, tp=2) == 65536
    assert spec.kv_bytes_per_token(2, tp=8) == 16384
    # 16 GPUs > 8 KV heads: each GPU still holds one (replicated) KV head
    assert spec.kv_bytes_per_token(2, tp=16) == 16384
    assert spec.kv_bytes_per_token(1) == 65536  # fp8 KV


def test_tied_embeddings_read_once():
    spec = load_model_spec("smollm2-135m")
    assert spec.tie_word_embeddings
    # every parameter is read each decode step: the tied table is the LM head
    assert spec.weight_params_read(1) == spec.total_params()
    assert spec.active_params() == spec.total_params()
    untied = load_model_spec("llama-3-8b")
    assert untied.weight_params_read(1) == untied.total_params() - untied.embedding_params


def test_moe_weight_read_grows_with_batch():
    spec = load_model_spec("deepseek-v3")
    r1, r32, rbig = spec.weight_params_read(1), spec.weight_params_read(32), spec.weight_params_read(1e6)
    assert r1 < r32 < rbig
    assert r1 == pytest.approx(spec.active_params(), rel=1e-9)
    assert rbig == pytest.approx(spec.total_params() - spec.embedding_params, rel=1e-6)
    assert spec.expected_experts_touched(1) == pytest.approx(8)
    assert spec.expected_experts_touched(1e6) == pytest.approx(256)


def _write_config(tmp_path, cfg):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_hf_config_dir_matches_preset(tmp_path):
    cfg = dict(MODEL_PRESETS["qwen3-8b"], architectures=["Qwen3ForCausalLM"])
    spec = load_model_spec(_write_config(tmp_path, cfg))
    preset = load_model_spec("qwen3-8b")
    assert spec.total_params() == preset.total_params()
    assert spec.kv_bytes_per_token(2) == preset.kv_bytes_per_token(2) == 36 * 2 * 8 * 128 * 2
    assert spec.name == "model"


def test_hf_config_dir_unknown_architecture_uses_json(tmp_path):
    cfg = {"model_type": "my-unknown-arch", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": True,
           "torch_dtype": "float32"}
    spec = load_model_spec(_write_config(tmp_path, cfg))
    assert spec.head_dim == 64
    assert spec.kv_bytes_per_token(4) == 4 * 2 * 2 * 64 * 4
    assert spec.native_dtype == "fp32"


def test_deepseek_from_transformers_config():
    from transformers import DeepseekV3Config

    spec = ModelSpec.from_hf_config(DeepseekV3Config(), name="ds")
    preset = load_model_spec("deepseek-v3")
    assert spec.kv_values_per_token_per_layer() == 576
    assert spec.total_params() == pytest.approx(preset.total_params(), rel=1e-3)


def test_from_llama_pretrained_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.total_params() == load_model_spec("smollm2-135m").total_params()


def test_dtype_names():
    assert normalize_dtype("bfloat16") == "bf16"
    assert normalize_dtype("torch.float32") == "fp32"
    assert normalize_dtype("float8_e4m3fn") == "fp8"
    with pytest.raises(ValueError):
        normalize_dtype("int3")


def test_fp8_flops_fallback_on_a100():
    a100 = get_hardware("a100-80gb")
    assert a100.flops_for("fp8") == a100.flops_for("bf16") == 312e12
    h100 = get_hardware("h100-sxm")
    assert h100.flops_for("fp8") == pytest.approx(2 * h100.flops_for("bf16"), rel=1e-3)


def test_saturation_batch_dense_closed_form():
    p = PlanInputs(load_model_spec("llama-3-8b"), get_hardware("h100-sxm"), context=4096)
    w = decode_at(p, 1)["weight_bytes_read"]
    expected = w / (4096 * p.model.kv_bytes_per_token(2))
    assert saturation_batch(p) == pytest.approx(expected, rel=1e-6)


def test_decode_becomes_compute_bound_at_huge_batch_short_context():
    p = PlanInputs(load_model_spec("llama-3-8b"), get_hardware("h100-sxm"), context=16, batch=1)
    assert decode_at(p, 1)["bound"] == "memory"
    assert decode_at(p, 4096)["bound"] == "compute"
    # intensity ~ batch at short context
    assert decode_at(p, 64)["intensity"] == pytest.approx(64, rel=0.1)


def test_prefill_is_compute_bound_and_scales():
    p = PlanInputs(load_model_spec("llama-3-8b"), get_hardware("h100-sxm"), context=2048)
    pre = prefill(p)
    assert pre["prefill_bound"] == "compute"
    # ~2 * 7.5G * 2048 FLOPs at 989 TFLOP/s ~ 31 ms, plus attention
    assert 25e-3 < pre["prefill_s"] < 45e-3
    assert prefill(p, 4096)["prefill_s"] > 2 * pre["prefill_s"]  # attention is quadratic


def test_budget_from_utilization_and_fit():
    p = PlanInputs(load_model_spec("llama-3-8b"), get_hardware("l4"), gpu_memory_utilization=0.9, context=4096, batch=4)
    r = make_plan(p).results
    hw = get_hardware("l4")
    assert r["kv_budget_bytes"] == pytest.approx(hw.memory_bytes * 0.9 - r["weight_bytes_per_gpu"]
                                                 - r["activation_reserve_bytes"])
    assert r["weights_fit"]
    assert r["kv_fits_at_batch"]
    big = make_plan(PlanInputs(load_model_spec("llama-3-8b"), hw, context=4096, batch=64)).results
    assert not big["kv_fits_at_batch"]
    # a 70B model in bf16 does not fit an L4 at all
    r70 = make_plan(PlanInputs(load_model_spec("llama-3-70b"), hw)).results
    assert not r70["weights_fit"] and r70["kv_blocks"] == 0 and r70["paged_max_seqs"] == 0


def test_paged_never_worse_than_naive():
    p = PlanInputs(load_model_spec("qwen3-8b"), get_hardware("h100-sxm"), kv_budget_bytes=20 * GiB,
                   context=8192, avg_context=1000)
    r = make_plan(p).results
    assert r["paged_max_seqs"] >= r["naive_max_seqs"] >= r["max_seqs_at_context"] - 1
    assert r["kv_tokens"] == r["kv_blocks"] * 16
    assert math.isfinite(r["saturation_batch"])


def test_sliding_window_layers_read_their_window_only():
    """Gemma-3-1B's shape: 22 of 26 layers see their last 512 positions.  A decode token at 32k reads 4 full
    layers' keys and values and 22 windows; the pool still holds every layer's (capacity unchanged); the planner
    counts exactly the layers the engine gives a window (llama.layer_sliding_window)."""
    from transformers import Gemma3TextConfig

    from roofline.model_executor.models.llama import layer_sliding_window
    from roofline.planner.model_specs import ModelSpec

    cfg = Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=256, sliding_window=512, vocab_size=262144,
                           max_position_embeddings=32768)
    spec = ModelSpec.from_hf_config(cfg)
    engine_windows = [layer_sliding_window(cfg, i) for i in range(26)]
    assert (spec.sliding_window, spec.num_sliding_layers) == (512, sum(w == 512 for w in engine_windows)) == (512, 22)
    per_layer = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bf16
    assert spec.kv_bytes_read_per_token(32768, 2) == (4 * 32768 + 22 * 512) * per_layer
    assert spec.kv_bytes_read_per_token(300, 2) == 26 * 300 * per_layer  # within the window: every layer reads all
    assert spec.kv_bytes_per_token(2) == 26 * per_layer
    assert spec.attention_flops_per_token(32768) == 2.0 * (4 * 32768 + 22 * 512) * 4 * (256 + 256)
    assert "22 of 26 layers see 512" in spec.summary()["sliding_window"]


def test_a_model_wide_window_slides_every_layer_unless_it_spans_the_context():
    from transformers import LlamaConfig, MistralConfig

    from roofline.planner.model_specs import ModelSpec

    small = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, vocab_size=1000)
    mistral = ModelSpec.from_hf_config(MistralConfig(sliding_window=4096, max_position_embeddings=32768, **small))
    assert (mistral.sliding_window, mistral.num_sliding_layers) == (4096, 4)
    spanning = ModelSpec.from_hf_config(MistralConfig(sliding_window=4096, max_position_embeddings=4096, **small))
    assert spanning.num_sliding_layers == 0
    assert ModelSpec.from_hf_config(LlamaConfig(**small)).num_sliding_layers == 0


def test_the_longest_request_counts_sliding_windows_as_the_engine_does():
    """The planner's longest request in a budget against the hybrid KV manager's on the same blocks."""
    from transformers import Gemma3TextConfig

    from roofline.core.hybrid_kv_cache_manager import HybridKVCacheManager
    from roofline.planner.cost_model import max_request_tokens
    from roofline.planner.model_specs import ModelSpec

    cfg = Gemma3TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=64, sliding_window=64, vocab_size=1000)
    spec = ModelSpec.from_hf_config(cfg)  # 10 sliding, 2 full: groups of 2 layers, 5 sliding + 1 full
    bs, layer_block = 16, 16 * 2 * 64 * 4
    budget = 300 * 2 * layer_block  # 300 blocks of 2 layers
    kv = HybridKVCacheManager(300, bs, [64] * 5 + [0])
    assert max_request_tokens(spec, budget, bs, 4) == kv.capacity_tokens()
    plain = ModelSpec.from_hf_config(Gemma3TextConfig(**dict(cfg.to_dict(), sliding_window=None,
                                                             layer_types=["full_attention"] * 12)))
    assert max_request_tokens(plain, budget, bs, 4) == 300 * 2 * bs // 12


def test_linear_attention_layers_keep_a_state_not_kv():
    """Qwen3-Next-80B-A3B's shape: 36 of 48 layers are Gated DeltaNet (full_attention_interval 4), so KV per token
    counts the 12 full-attention layers; each request keeps a fixed fp32 state per linear layer (conv state +
    matrix state) that a decode step reads and writes once -- the same bytes the engine's recurrent specs
    declare.  On a tiny checkpoint the parameter count is HF's."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    from roofline.attention import kv_spec
    from roofline.model_executor.models.qwen3_next import GatedDeltaNet
    from roofline.planner.model_specs import ModelSpec
    from tests.reference.hf_models import tiny_config

    cfg = Qwen3NextConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                          head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                          linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                          num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                          shared_expert_intermediate_size=512, vocab_size=151936)
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.num_linear_layers, spec.num_attention_layers) == (36, 12)
    assert spec.kv_bytes_per_token(2) == 12 * 2 * 2 * 256 * 2  # K and V, 2 KV heads of 256, bf16, 12 layers
    conv_dim = 2 * 16 * 128 + 32 * 128
    state = 36 * (conv_dim * 3 + 32 * 128 * 128) * 4
    assert spec.recurrent_state_bytes() == state and spec.recurrent_state_bytes(tp=2) == state / 2
    with torch.device("meta"):
        engine = [GatedDeltaNet(cfg, i).kv_cache_spec() for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    assert kv_spec.state_bytes(engine, 1) == state
    assert spec.kv_bytes_read_per_token(1000, 2) == 12 * 1000 * 2 * 2 * 256 * 2 + 2 * state
    assert spec.request_kv_bytes(1000, 16, 2) == 12 * 63 * 16 * 2 * 2 * 256 * 2 + state
    assert "36 of 48 layers" in spec.summary()["linear_attention"]

    tiny = tiny_config("qwen3_next")
    hf = AutoModelForCausalLM.from_config(tiny)
    assert ModelSpec.from_hf_config(tiny).total_params() == sum(p.numel() for p in hf.parameters())
