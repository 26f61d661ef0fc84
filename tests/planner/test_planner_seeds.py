"""The seeds' worked numbers, reproduced by the planner with the seeds' explicit inputs.

The seeds round freely ("40 GB / 5 MB = 8000 blocks", "320 KB/token", "35 GB" of weights) and mix
decimal and binary units. The planner is exact for the inputs it is given, so each test states the
inputs it uses and the tolerance that covers the seed's own rounding.
"""

import math

import pytest

from roofline.planner.cost_model import (
    PlanInputs,
    decode_at,
    decode_step_time,
    kv_pool,
    make_plan,
    naive_capacity,
    paged_capacity,
    saturation_batch,
)
from roofline.planner.hardware import GiB, MiB, get_hardware
from roofline.planner.model_specs import load_model_spec

LLAMA3_70B_KV_PER_TOKEN = 80 * 8 * 128 * 2 * 2  # layers x kv heads x head_dim x (K,V) x bf16 = 327,680 B


def rel(a, b):
    return abs(a - b) / abs(b)


def test_llama3_70b_kv_bytes_per_token_and_block():
    # deep-dive-08 section 1.4 / 5.1: 327,680 B/token; a 16-token block is 64 KB per layer, 5.12 "MB" over 80 layers
    spec = load_model_spec("llama-3-70b")
    assert spec.kv_bytes_per_token(2) == LLAMA3_70B_KV_PER_TOKEN == 327_680
    assert 16 * spec.kv_bytes_per_token(2) / spec.num_layers == 65_536
    # section 5.7: an 8K sequence needs 512 blocks = 2.6 GB (8192 x 320 KB)
    assert math.ceil(8192 / 16) == 512
    assert rel(512 * 16 * spec.kv_bytes_per_token(2), 2.6e9) < 0.05


def test_exercise1_kv_pool():
    """Exercise 1: 40 GB KV budget, block 16, 320 KB/token -> 8000 blocks, 128K tokens, 32 seqs at 4096.

    Input: a 40 GiB budget. The seed's "5 MB" block is exactly 5 MiB (16 x 320 KiB), so the pool is
    40 GiB / 5 MiB = 8192 blocks (the seed's 8000 divides 40,000 by 5; within 2.5%), 131,072 tokens
    (= the seed's "128K" exactly) and 32 fully-grown 4096-token sequences (exact)."""
    pool = kv_pool(40 * GiB, LLAMA3_70B_KV_PER_TOKEN, 16)
    assert pool["kv_block_bytes"] == 5 * MiB
    assert rel(pool["kv_blocks"], 8000) < 0.025
    assert pool["kv_blocks"] == 8192
    assert pool["kv_tokens"] == 128 * 1024
    assert paged_capacity(pool["kv_blocks"], 4096, 16) == 32

    # the same through the full planner (fp8 weights so the 70B model is on one H100, as the exercise assumes)
    p = PlanInputs(load_model_spec("llama-3-70b"), get_hardware("h100-sxm"), weight_dtype="fp8", kv_dtype="bf16",
                   kv_budget_bytes=40 * GiB, block_size=16, context=4096)
    r = make_plan(p).results
    assert r["kv_bytes_per_token"] == LLAMA3_70B_KV_PER_TOKEN
    assert r["kv_blocks"] == 8192 and r["kv_tokens"] == 131072 and r["max_seqs_at_context"] == 32
    assert rel(r["weight_bytes_per_gpu"], 70e9) < 0.02  # "FP8 quantization at 70 GB"


def test_exercise2_decode_step_times_explicit_formula():
    """Exercise 2 with its literal inputs: (35 GB + b x 320 MB) / 1.675 TB/s."""
    bw = 1.675e12
    t1 = decode_step_time(35e9, 320e6 / 2048, 1, 2048, bw)["step_time_s"]
    t32 = decode_step_time(35e9, 320e6 / 2048, 32, 2048, bw)["step_time_s"]
    assert rel(t1 * 1e3, 21) < 0.02  # seed: ~21 ms
    assert rel(t32 * 1e3, 27) < 0.02  # seed: ~27 ms
    # "doubles when b x 320 MB = 35 GB -> b ~ 110"
    assert rel(35e9 / 320e6, 110) < 0.01


def test_exercise2_decode_step_times_from_model():
    """Exercise 2 through the planner: Llama-3-70B, TP=2, fp8 weights (35 GB per GPU; the exercise's
    'BF16' weights would be 70 GB per GPU, so its 35 GB implies 8-bit weights), bf16 KV, S = 2048,
    bandwidth overridden to 1.675 TB/s. Tolerance 5%: the planner counts 69.5 G weights read per
    step (the input-embedding table is gathered, not read) and 335.5 MB of KV per sequence per GPU,
    the seed rounds to 35 GB and 320 MB."""
    hw = get_hardware("h100-sxm").with_overrides(hbm_bandwidth_tbs=1.675)
    p = PlanInputs(load_model_spec("llama-3-70b"), hw, tp=2, weight_dtype="fp8", kv_dtype="bf16", context=2048)
    assert rel(make_plan(p).results["weight_bytes_per_gpu"], 35e9) < 0.02
    assert p.model.kv_bytes_per_token(2, tp=2) * 2048 == 320 * MiB  # "KV halved by TP"
    t1 = decode_at(p, 1)
    t32 = decode_at(p, 32)
    assert t1["bound"] == "memory" and t32["bound"] == "memory"
    assert rel(t1["step_time_s"] * 1e3, 21) < 0.05
    assert rel(t32["step_time_s"] * 1e3, 27) < 0.05
    assert rel(saturation_batch(p), 110) < 0.10  # seed: "b ~ 110"
    # and at the saturation batch the step time is twice the batch-1 weight time
    b = saturation_batch(p)
    w = decode_at(p, b)
    assert w["kv_bytes_read"] == pytest.approx(w["weight_bytes_read"], rel=1e-6)


def test_exercise4_naive_vs_paged():
    """Exercise 4: 40 GB KV budget, max_model_len 4096, average length 800, block 16.

    Seed: naive 40 GB / 1.28 GB = 31; paged 40 GB / 250 MB = 160; 5x. With the exact bytes
    (40 GiB budget, 4096 x 327,680 B = 1.25 GiB per reservation, 50 blocks x 5 MiB = 250 MiB per
    paged sequence) the planner gives 32 and 163: within 1 sequence and 2.5% of the seed."""
    p = PlanInputs(load_model_spec("llama-3-70b"), get_hardware("h100-sxm"), weight_dtype="fp8", kv_dtype="bf16",
                   kv_budget_bytes=40 * GiB, block_size=16, context=4096, avg_context=800)
    r = make_plan(p).results
    assert abs(r["naive_max_seqs"] - 31) <= 1
    assert r["naive_max_seqs"] == naive_capacity(40 * GiB, LLAMA3_70B_KV_PER_TOKEN, 4096) == 32
    assert math.ceil(800 / 16) == 50
    assert rel(r["paged_max_seqs"], 160) < 0.025
    assert r["paged_max_seqs"] == 163
    assert rel(r["paged_max_seqs"] / r["naive_max_seqs"], 5) < 0.05  # "5x more concurrent users"


def test_llama2_7b_kv_bytes_and_decode_intensity():
    """llm-stories-06 section 3: K_tok = 2*32*32*128*2 = 512 KB; decode at B=32, L=1k moves
    ~14 GB of weights + ~16 GB of KV = ~30 GB and has intensity ~15 FLOP/byte.

    Explicit seed inputs (Pi = 7e9, L = 1000): 2*Pi*B / (2*Pi + K*L*B) = 14.6. The planner's exact
    model (6.61 G params read, attention FLOPs counted, L = 1024) gives 14.5. Tolerance 10%."""
    spec = load_model_spec("llama-2-7b")
    assert spec.kv_bytes_per_token(2) == 2 * 32 * 32 * 128 * 2 == 512 * 1024

    pi, k_tok, b, L = 7e9, 512 * 1024, 32, 1000
    seed_formula = 2 * pi * b / (2 * pi + k_tok * L * b)
    assert rel(seed_formula, 15) < 0.05

    p = PlanInputs(spec, get_hardware("h100-sxm"), weight_dtype="bf16", kv_dtype="bf16", context=1024, batch=32)
    r = make_plan(p).results
    assert rel(r["decode_weight_bytes_read"], 14e9) < 0.10
    assert rel(r["decode_kv_bytes_read"], 16 * GiB) < 0.01  # 32 x 1024 x 512 KiB
    assert rel(r["decode_weight_bytes_read"] + r["decode_kv_bytes_read"], 30e9) < 0.05
    assert rel(r["decode_intensity_flops_per_byte"], 15) < 0.10
    # L = 4k row: ~5.7 FLOP/byte (planner: 6.0 with attention FLOPs counted)
    assert rel(decode_at(p, 32, 4096)["intensity"], 5.7) < 0.10
    # crossover L*B = 2*Pi/K_tok ~ 27k -> L ~ 850 at B = 32 (the saturation point, in context units)
    assert rel(14e9 / k_tok, 27e3) < 0.02
    assert rel(saturation_batch(p, context=850), 32) < 0.10


def test_ridge_points():
    # deep-dive-08 section 2.1: H100 SXM bf16 990 TFLOP/s / 3.35 TB/s = 295 FLOP/byte
    p = PlanInputs(load_model_spec("llama-3-8b"), get_hardware("h100-sxm"), weight_dtype="bf16")
    assert rel(make_plan(p).results["ridge_flops_per_byte"], 295) < 0.01
    # llm-stories-06: with ~500 TFLOP/s sustained the ridge is ~150
    p = PlanInputs(load_model_spec("llama-3-8b"), get_hardware("h100-sxm").with_overrides(peak_tflops=500),
                   weight_dtype="bf16")
    assert rel(make_plan(p).results["ridge_flops_per_byte"], 150) < 0.01


def test_deepseek_v3_mla_bytes_per_token():
    """The MLA cache holds the 512-d latent + the 64-d decoupled RoPE key = 576 values per token per
    layer (the '576-d latent blocks' of the DeepSeek deployment notes), over 61 layers."""
    spec = load_model_spec("deepseek-v3")
    assert spec.is_mla and spec.is_moe
    assert spec.kv_values_per_token_per_layer() == 512 + 64 == 576
    assert spec.kv_bytes_per_token(2) == 61 * 576 * 2 == 70_272
    assert spec.kv_bytes_per_token(1) == 35_136  # fp8 KV
    # plain TP does not split the latent: every rank holds the whole cache
    assert spec.kv_bytes_per_token(2, tp=8) == 70_272
    # vs. an MHA cache of the same model (128 heads x (192-d K + 128-d V)), MLA is ~71x smaller
    assert 128 * (192 + 128) / 576 == pytest.approx(71.1, rel=0.01)
    # 671B total, ~37B active
    assert rel(spec.total_params(), 671e9) < 0.005
    assert rel(spec.active_params() + spec.embedding_params, 37e9) < 0.03
