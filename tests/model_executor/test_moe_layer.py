"""FusedMoE (roofline/model_executor/layers/moe/layer.py): the torch reference expert compute against
HF transformers' experts module on the same weights, the native CPU paths (the whole layer in one
grouped call for 16-aligned widths; packed per-expert GEMMs and GEMV for lone rows otherwise) against
the reference and against each other, per-expert and stacked 3-D loading, tensor-parallel
slices that sum to the whole, and load-time errors that name the field."""

from __future__ import annotations

import pytest
import torch

from roofline.distributed.parallel_state import tp_group_as
from roofline.cpu import ops as cpu_ops
from roofline.model_executor.layers.moe import FusedMoE, RoutingConfig, cpu_experts, select_experts
from roofline.model_executor.layers.moe.torch_experts import ExpertActivation, torch_experts

E, H = 8, 64


def _experts(inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, inter, H, generator=g) * 0.2
    up = torch.randn(E, inter, H, generator=g) * 0.2
    down = torch.randn(E, H, inter, generator=g) * 0.2
    return gate, up, down


def _layer(inter: int, gate, up, down, routing=None, tp=(0, 1), activation=None, biases=None) -> FusedMoE:
    """biases: (b_gate [E, I], b_up [E, I], b_down [E, H]) or None."""
    extra = {} if activation is None else dict(activation=activation)
    with tp_group_as(*tp):
        layer = FusedMoE(E, H, inter, routing or RoutingConfig(top_k=2, renormalize=True), bias=biases is not None,
                         **extra)
    for e in range(E):
        layer.weight_loader(layer.w13_weight, gate[e], "w1", e)
        layer.weight_loader(layer.w13_weight, up[e], "w3", e)
        layer.weight_loader(layer.w2_weight, down[e], "w2", e)
        if biases is not None:
            for b, shard in zip(biases, ("w1", "w3", "w2")):
                layer.bias_loader(b[e], shard, e)
    assert layer.missing_experts() == []
    return layer


def _route(n: int, k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, E, generator=g)
    x = torch.randn(n, H, generator=g)
    w, ids = select_experts(logits, RoutingConfig(top_k=k, renormalize=True))
    return x, logits, w, ids


def test_reference_matches_hf_experts():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    inter = 48
    gate, up, down = _experts(inter)
    hf = MixtralExperts(MixtralConfig(hidden_size=H, intermediate_size=inter, num_local_experts=E)).eval()
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
        hf.down_proj.copy_(down)
    layer = _layer(inter, gate, up, down)
    x, _, w, ids = _route(19, 2)
    with torch.no_grad():
        expected = hf(x, ids, w)
    torch.testing.assert_close(torch_experts(x, layer.w13_weight, layer.w2_weight, w, ids), expected,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")
@pytest.mark.parametrize("inter", [32, 40])  # 16-aligned (fused SiLU GEMM) and not
@pytest.mark.parametrize("n,k", [(1, 2), (2, 1), (5, 2), (37, 3), (300, 2)])  # 300 x 2: experts past 96 rows
def test_cpu_experts_match_reference(inter, n, k):
    gate, up, down = _experts(inter, seed=inter)
    layer = _layer(inter, gate, up, down, RoutingConfig(top_k=k, renormalize=True))
    x, logits, w, ids = _route(n, k, seed=n)
    expected = torch_experts(x, layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone(), w, ids)
    layer.prepare_cpu()
    assert layer.cpu_experts is not None and layer.cpu_experts.takes(x)
    assert layer.w13_weight.stride(1) == 1  # each expert's dense matrix [in x out]-major for the GEMV
    got = layer(x, logits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for switch in (cpu_ops.SWITCH, cpu_experts.SWITCH):  # either off: the torch reference on the relaid weights
        with switch.forced(False):
            assert not layer.cpu_experts.takes(x)
            torch.testing.assert_close(layer(x, logits), expected, rtol=1e-6, atol=1e-6)


def test_stacked_checkpoint_tensors_load_as_per_expert():
    inter = 32
    gate, up, down = _experts(inter)
    per_expert = _layer(inter, gate, up, down)
    stacked = FusedMoE(E, H, inter, RoutingConfig(top_k=2))
    stacked.load_stacked("gate_up_proj", torch.cat([gate, up], dim=1))
    assert {s for _, s in stacked.missing_experts()} == {"w2"}
    stacked.load_stacked("down_proj", down)
    assert stacked.missing_experts() == []
    assert torch.equal(stacked.w13_weight, per_expert.w13_weight)
    assert torch.equal(stacked.w2_weight, per_expert.w2_weight)
    with pytest.raises(ValueError, match="gate_up_proj"):
        stacked.load_stacked("gate_up_proj", torch.cat([gate, up], dim=2))


def test_tensor_parallel_slices_sum_to_the_whole():
    """Two ranks' un-reduced outputs add up to the unsharded layer's output."""
    inter = 32
    gate, up, down = _experts(inter)
    whole = _layer(inter, gate, up, down)
    x, logits, _, _ = _route(9, 2)
    parts = []
    for rank in range(2):
        with tp_group_as(rank, 2):
            layer = FusedMoE(E, H, inter, RoutingConfig(top_k=2, renormalize=True), reduce_results=False)
        assert layer.w13_weight.shape == (E, inter, H) and layer.w2_weight.shape == (E, H, inter // 2)
        for e in range(E):
            layer.weight_loader(layer.w13_weight, gate[e], "w1", e)
            layer.weight_loader(layer.w13_weight, up[e], "w3", e)
            layer.weight_loader(layer.w2_weight, down[e], "w2", e)
        parts.append(layer(x, logits))
    torch.testing.assert_close(parts[0] + parts[1], whole(x, logits), rtol=1e-5, atol=1e-5)


def test_tp_that_does_not_divide_the_expert_width_names_the_field():
    with tp_group_as(0, 3), pytest.raises(ValueError, match="moe_intermediate_size .32. is not divisible"):
        FusedMoE(E, H, 32, RoutingConfig(top_k=2))
    with tp_group_as(0, 3), pytest.raises(ValueError, match="intermediate_size"):
        FusedMoE(E, H, 32, RoutingConfig(top_k=2), width_field="intermediate_size")


def test_missing_expert_tensor_is_reported():
    inter = 32
    gate, up, down = _experts(inter)
    layer = FusedMoE(E, H, inter, RoutingConfig(top_k=2))
    for e in range(E):
        layer.weight_loader(layer.w13_weight, gate[e], "w1", e)
        layer.weight_loader(layer.w2_weight, down[e], "w2", e)
        if e != 3:
            layer.weight_loader(layer.w13_weight, up[e], "w3", e)
    assert layer.missing_experts() == [(3, "w3")]
    with pytest.raises(ValueError, match="expected"):
        layer.weight_loader(layer.w2_weight, gate[0], "w2", 0)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,k", [(1, 1), (6, 3), (250, 2)])
def test_grouped_native_call_gives_the_per_expert_calls_bits(threads, n, k):
    """cpu_ops.moe_experts (one call per layer) runs each expert's rows through the same packed-GEMM
    work items as one gemm_packed_silu_mul + gemm_packed per expert: the same bits, at any thread count."""
    inter = 32
    gate, up, down = _experts(inter, seed=3)
    layer = _layer(inter, gate, up, down, RoutingConfig(top_k=k, renormalize=True))
    layer.prepare_cpu()
    x, _, w, ids = _route(n, k, seed=n + 7)
    ce = layer.cpu_experts
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ce(x, layer.w13_weight, layer.w2_weight, w, ids)
        expected = torch.zeros_like(x)
        for t in range(n):  # per token, its slots in order: weight * expert(x_t)
            for j in range(k):
                e = int(ids[t, j])
                h = cpu_ops.gemm_packed_silu_mul(x[t:t + 1], ce.w13_packed[e], inter)
                y = cpu_ops.gemm_packed(h, ce.w2_packed[e], H) * w[t, j]
                expected[t] = y[0] if j == 0 else expected[t] + y[0]
    finally:
        torch.set_num_threads(old)
    assert torch.equal(got, expected)


OSS = ExpertActivation("clamped_swiglu", alpha=1.702, limit=0.9)  # a limit the projections pass (the clamps bite)


def _biases(inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, inter, generator=g) * 0.3, torch.randn(E, inter, generator=g) * 0.3,
            torch.randn(E, H, generator=g) * 0.3)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")
@pytest.mark.parametrize("inter", [32, 40])  # 16-aligned and not: both take the one native call
@pytest.mark.parametrize("n,k", [(1, 2), (5, 2), (37, 3), (300, 2)])
@pytest.mark.parametrize("kind", ["clamped_swiglu", "silu"])
def test_cpu_experts_with_biases_and_the_clamped_swiglu_match_reference(inter, n, k, kind):
    """gpt-oss's experts (gate/up and down biases, the clamped SwiGLU) on the native grouped call: within fp32
    rounding of torch_experts, the clamps reached; SiLU experts with biases take the unfused route too."""
    act = OSS if kind == "clamped_swiglu" else ExpertActivation()
    gate, up, down = _experts(inter, seed=inter + 1)
    biases = _biases(inter, seed=inter + 2)
    layer = _layer(inter, gate, up, down, RoutingConfig(top_k=k, renormalize=True), activation=act, biases=biases)
    x, logits, w, ids = _route(n, k, seed=n + 3)
    w13, w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
    expected = torch_experts(x, w13, w2, w, ids, act, layer.w13_bias, layer.w2_bias)
    assert not torch.allclose(expected, torch_experts(x, w13, w2, w, ids, act), atol=1e-3)  # the biases count
    if kind == "clamped_swiglu":
        h = torch.einsum("nh,eih->nei", x, w13) + layer.w13_bias
        assert (h[..., :inter] > OSS.limit).any() and (h[..., inter:].abs() > OSS.limit).any()
    layer.prepare_cpu()
    assert layer.cpu_experts is not None and layer.cpu_experts.takes(x)
    torch.testing.assert_close(layer(x, logits), expected, rtol=1e-5, atol=1e-5)
    with cpu_experts.SWITCH.forced(False):  # the torch reference on the relaid weights (other GEMM kernels)
        torch.testing.assert_close(layer(x, logits), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")
def test_cpu_experts_with_biases_under_tensor_parallelism_sum_to_the_whole():
    """Two TP slices of a biased clamped-SwiGLU layer on the native call: rank 0 adds the down bias, rank 1 not,
    and their partial sums add up to the whole layer's output."""
    inter = 64
    gate, up, down = _experts(inter, seed=5)
    biases = _biases(inter, seed=6)
    x, logits, w, ids = _route(23, 2, seed=7)
    whole = _layer(inter, gate, up, down, activation=OSS, biases=biases)
    expected = torch_experts(x, whole.w13_weight, whole.w2_weight, w, ids, OSS, whole.w13_bias, whole.w2_bias)
    parts = []
    for rank in range(2):
        layer = _layer(inter, gate, up, down, tp=(rank, 2), activation=OSS, biases=biases)
        layer.prepare_cpu()
        assert layer.cpu_experts is not None
        parts.append(layer.experts(x, w, ids))
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")
def test_moe_experts_refuses_what_it_cannot_compute():
    inter = 40
    gate, up, down = _experts(inter)
    layer = _layer(inter, gate, up, down)
    layer.prepare_cpu()
    ce = layer.cpu_experts
    x, _, w, ids = _route(3, 2)
    tokens = torch.zeros(6, dtype=torch.int64)
    offsets = torch.tensor([0, 6] + [6] * (E - 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="multiple of 16"):  # SiLU fused into the GEMM needs 16-column panels
        cpu_ops.moe_experts(x, tokens, tokens, torch.ones(6), offsets, ce.w13_packed, ce.w2_packed, inter)
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        cpu_ops.moe_experts(x, tokens, tokens, torch.ones(6), offsets, ce.w13_packed, ce.w2_packed, inter,
                            activation="gelu")
    with pytest.raises(ValueError, match="bias of shape"):
        cpu_ops.moe_experts(x, tokens, tokens, torch.ones(6), offsets, ce.w13_packed, ce.w2_packed, inter,
                            b13=torch.zeros(E, inter), activation="clamped_swiglu", alpha=1.0, limit=1.0)
