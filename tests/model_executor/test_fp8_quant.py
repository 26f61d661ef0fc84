"""FP8 block weights computed natively on the CPU (fp8_kernels.c, cpu/fp8_quant.py) and the tensor layers keep
(layers/quantization/fp8.py): every byte's value exactly torch's e4m3 times its block scale, the GEMV's rows
the one-row GEMV's, the GEMM bit for bit the packed GEMM over the dequantized weight, in every build."""

import pytest
import torch
import torch.nn.functional as F

from roofline.cpu import gemm as cpu_gemm, ops as cpu_ops, fp8_quant
from roofline.model_executor.layers.quantization import checkpoint_quantization
from roofline.model_executor.layers.quantization.fp8 import Fp8BlockTensor, fp8_checkpoint_weights
from tests.reference.fp8_checkpoint import quantize_blocks
from tests.reference.isa_builds import each_vector_build

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable (no C compiler)")


def random_fp8(n: int, k: int, block=(128, 128), seed: int = 0) -> Fp8BlockTensor:
    """A weight quantized as DeepSeek's checkpoints are, with every byte value but NaN somewhere in row 0."""
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_blocks(torch.randn(n, k, generator=g) * 0.05, block)
    data = q.view(torch.uint8).clone()
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every & 0x7F) != 0x7F]  # e4m3's NaN bytes never reach the kernels
    m = min(k, every.numel())
    data[0, :m] = every[:m]
    return Fp8BlockTensor(data, s * torch.exp(torch.randn(s.shape, generator=g)), block[0], block[1])


def reference(x, w):
    return F.linear(x.double(), w.double()).float()


SHAPES = [(40, 576, (128, 128)), (300, 256, (128, 128)), (37, 96, (16, 32)), (33, 100, (8, 16))]


@pytest.mark.parametrize("n,k,block", SHAPES)
def test_expansion_is_exactly_torchs_dequantization(n, k, block):
    w = random_fp8(n, k, block, seed=n)
    want = fp8_quant.dequantize_reference(w.data, w.scale, w.scale_rows, w.block_k)
    expected = w.data.view(torch.float8_e4m3fn).float() * fp8_quant.expand_scales(w.scale, n, k, *block)
    assert torch.equal(want.view(torch.int32), expected.view(torch.int32))
    got = fp8_quant.dequantize_native(w.data, w.scale, w.scale_rows, w.block_k)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # subnormals and signed zeros included


@pytest.mark.parametrize("n,k,block", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_gemv_rows_are_the_one_row_gemv(n, k, block, threads):
    """1..8 rows (decodes, a speculative verify): each row's values are the single-row GEMV's, bit for bit,
    whatever the thread count, and within fp32 rounding of the product over the dequantized weight."""
    w = random_fp8(n, k, block, seed=k)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(n))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        one = torch.cat([w.linear(x[i:i + 1], bias) for i in range(8)])
        for m in range(1, 9):
            assert torch.equal(w.linear(x[:m], bias), one[:m]), m
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, reference(x, w.dequantize()) + bias, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n,k,block", SHAPES)
@pytest.mark.parametrize("m", [9, 40, 130])
def test_gemm_is_the_packed_gemm_over_the_dequantized_weight(n, k, block, m):
    w = random_fp8(n, k, block, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    dense = w.dequantize()
    want = cpu_ops.gemm_packed(x, cpu_ops.pack_panels(dense), n)
    assert torch.equal(w.linear(x), want)
    assert cpu_gemm.routes_alike(m, 9, [w]) and cpu_gemm.routes_alike(5, 8, [w]) and not cpu_gemm.routes_alike(9, 8, [w])


@pytest.mark.parametrize("m", [3, 20])
def test_gate_up_with_silu_is_the_projection_then_silu_and_mul(m):
    d = 48
    w = random_fp8(2 * d, 160, (16, 32), seed=7)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m))
    h = w.linear(x)
    want = cpu_ops.silu_and_mul(h)
    assert torch.equal(w.linear_silu_mul(x), want)


def _gemv_columns(w: Fp8BlockTensor) -> torch.Tensor:
    """The GEMV of every one-hot row e_k, as columns: each output is the expanded weight value alone (x 1, + 0)."""
    k = w.data.shape[1]
    return torch.cat([w.linear(torch.eye(k)[i:i + 1]) for i in range(k)]).t()


@pytest.mark.parametrize("n,k,block", SHAPES)
def test_gemv_expands_every_byte_exactly(n, k, block):
    """The GEMV's own expansion (fp32 bits where the scales allow, F16C otherwise) gives torch's dequantized
    values, subnormal bytes included (row 0 holds every byte)."""
    w = random_fp8(n, k, block, seed=n + k)
    assert torch.equal(_gemv_columns(w), w.dequantize())


def test_large_scales_take_the_f16c_expansion_with_the_same_bits():
    """Scale blocks of 2^7 and above cannot use the fp32-bits expansion (2^120 s would overflow): the same weight
    with every scale times 2^24 gives exactly 2^24 times the outputs (a power of two: no rounding differs)."""
    w = random_fp8(40, 576, seed=11)
    big = Fp8BlockTensor(w.data, w.scale * 2.0 ** 24, w.scale_rows, w.block_k, block_n=128)
    assert float(big.scale.abs().min()) >= 2 ** 7 > float(w.scale.abs().max())
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(4))
    for m in range(1, 5):
        assert torch.equal(big.linear(x[:m]), w.linear(x[:m]) * 2.0 ** 24), m


def test_flushed_denormals_take_the_f16c_expansion():
    """With denormal inputs flushed (MXCSR's DAZ, torch.set_flush_denormal), the fp32-bits expansion would zero
    e4m3's subnormals: the GEMV reads the thread's MXCSR and expands through F16C, still exact (one thread: the
    GEMV runs on this one)."""
    w = random_fp8(40, 576, seed=12)
    want = w.dequantize()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = _gemv_columns(w)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(before)
    assert torch.equal(got, want)


def test_every_vector_build_keeps_its_rows_the_one_row_gemv():
    w = random_fp8(45, 576, seed=3)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3))
    for isa in each_vector_build():
        one = torch.cat([w.linear(x[i:i + 1]) for i in range(8)])
        for m in range(2, 9):
            assert torch.equal(w.linear(x[:m]), one[:m]), (isa, m)
        torch.testing.assert_close(one, reference(x, w.dequantize()), atol=1e-4, rtol=1e-4)
        got = fp8_quant.dequantize_native(w.data, w.scale, w.scale_rows, w.block_k)
        assert torch.equal(got, w.dequantize()), isa


def test_portable_build_gives_the_same_values(portable_kernels):
    """The plain C build (no AVX2): the same exact expansion; products within fp32 rounding."""
    n, k = 21, 200
    w = random_fp8(n, k, (8, 16), seed=11)
    want = w.dequantize()
    out = torch.empty(n, k)
    portable_kernels.fp8_dequantize_f32(w.data.data_ptr(), n, k, w.scale.data_ptr(), w.scale.stride(0), 8, 16,
                                        out.data_ptr(), 2)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    for m in (1, 4, 100):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = torch.empty(m, n)
        portable_kernels.fp8_linear_f32(x.data_ptr(), k, w.data.data_ptr(), k, w.scale.data_ptr(), w.scale.stride(0),
                                        8, 16, None, y.data_ptr(), n, m, n, 2)
        torch.testing.assert_close(y, reference(x, want), atol=1e-4, rtol=1e-4)


def test_per_row_scales_fold_back_into_blocks():
    """A layer assembles its weight with a scale per row; compact() folds them into the checkpoint's
    blocks where every block's rows agree, and leaves them per row where shards broke the blocks."""
    w = random_fp8(300, 256, seed=5)
    rows = Fp8BlockTensor(w.data.clone(), w.row_scales().clone(), 1, 128, block_n=128)
    assert torch.equal(rows.dequantize(), w.dequantize())
    rows.compact()
    assert rows.scale_rows == 128 and torch.equal(rows.scale, w.scale)
    broken = Fp8BlockTensor(w.data.clone(), w.row_scales().clone(), 1, 128, block_n=128)
    broken.scale[5] *= 2
    broken.compact()
    assert broken.scale_rows == 1


def _config(**q):
    class Config:
        quantization_config = dict({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}, **q)
    return Config()


@pytest.mark.parametrize("field,value,match", [
    ("quant_method", "awq", "quant_method 'awq'"),
    ("fmt", "e5m2", "fmt 'e5m2'"),
    ("activation_scheme", "static", "activation_scheme 'static'"),
    ("weight_block_size", [128], "weight_block_size"),
    ("weight_block_size", None, "weight_block_size is missing"),
    ("weight_block_size", [128, 100], "multiple of 16"),
    ("weight_block_size", [0, 128], "weight_block_size"),
])
def test_quantization_config_we_cannot_honour_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        checkpoint_quantization(_config(**{field: value}))


def test_checkpoint_reader_joins_weights_and_scales_in_any_order():
    cfg = checkpoint_quantization(_config())
    q, s = quantize_blocks(torch.randn(200, 576), (128, 128))
    ordered = [("a.weight_scale_inv", s), ("a.weight", q), ("b.weight", q), ("norm.weight", torch.ones(3)),
               ("b.weight_scale_inv", s)]
    got = dict(fp8_checkpoint_weights(ordered, cfg, keep=True))
    assert set(got) == {"a.weight", "b.weight", "norm.weight"}
    assert isinstance(got["a.weight"], Fp8BlockTensor) and got["a.weight"].scale_rows == 128
    dense = dict(fp8_checkpoint_weights(ordered, cfg, keep=False))
    assert torch.equal(dense["b.weight"], got["b.weight"].dequantize())


@pytest.mark.parametrize("tensors,match", [
    (lambda q, s: [("a.weight", q)], "'a.weight_scale_inv' is missing"),
    (lambda q, s: [("a.weight_scale_inv", s)], "has no FP8 weight 'a.weight'"),
    (lambda q, s: [("a.weight", q), ("a.weight_scale_inv", s[:1])], r"needs \[2, 5\]"),
    (lambda q, s: [("a.weight", q), ("a.weight_scale", s)], "per-tensor"),
    (lambda q, s: [("a.weight", q.to(torch.float8_e5m2))], "not e4m3"),
    (lambda q, s: [("a.weight", torch.full_like(q.view(torch.uint8), 0x7F).view(torch.float8_e4m3fn)),
                   ("a.weight_scale_inv", s)], "NaN"),
    (lambda q, s: [("a.weight", q), ("a.weight_scale_inv", s * float("inf"))], "non-finite"),
])
def test_bad_checkpoint_tensors_are_named(tensors, match):
    cfg = checkpoint_quantization(_config())
    q, s = quantize_blocks(torch.randn(200, 576), (128, 128))
    with pytest.raises(ValueError, match=match):
        list(fp8_checkpoint_weights(tensors(q, s), cfg, keep=True))


def test_expert_stacks_stay_in_blocks_together_or_not_at_all():
    """FusedMoE keeps both expert stacks in FP8 blocks, or neither: a dense expert tensor after FP8 ones turns
    the layer dense (the blocks loaded so far dequantized), and either way it computes the reference."""
    from roofline.model_executor.layers.moe import FusedMoE, RoutingConfig, select_experts
    from roofline.model_executor.layers.moe.torch_experts import torch_experts

    e, h, inter = 4, 64, 32
    routing = RoutingConfig(top_k=2, renormalize=True)
    g = torch.Generator().manual_seed(0)
    tensors = {(x, s): random_fp8(*((h, inter) if s == "w2" else (inter, h)), (16, 16), seed=7 * x + len(s))
               for x in range(e) for s in ("w1", "w3", "w2")}
    x, logits = torch.randn(5, h, generator=g), torch.randn(5, e, generator=g)
    w, ids = select_experts(logits, routing)
    ref_w13 = torch.stack([torch.cat([tensors[x, "w1"].dequantize(), tensors[x, "w3"].dequantize()]) for x in range(e)])
    ref_w2 = torch.stack([tensors[x, "w2"].dequantize() for x in range(e)])
    want = torch_experts(x, ref_w13, ref_w2, w, ids)
    for dense_down in (False, True):
        layer = FusedMoE(e, h, inter, routing)
        for (x_id, s), t in tensors.items():
            layer.weight_loader(layer.w2_weight if s == "w2" else layer.w13_weight,
                                t.dequantize() if dense_down and s == "w2" else t, s, x_id)
        assert (layer.w13_quant is None) == dense_down and (layer.w2_quant is None) == dense_down
        torch.testing.assert_close(layer.experts(x, w, ids), want, atol=1e-5, rtol=1e-5)
