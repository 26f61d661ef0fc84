"""The block-FP8 Triton kernels (roofline/model_executor/layers/quantization/fp8_triton.py) against their
torch references; without a GPU through the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 set
before the kernels are defined, as in test_moe_triton.py).  The w8a8 GEMM needs FP8 tensor cores on a
GPU (sm >= 8.9) and runs everywhere under the interpreter."""

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import interpret_without_gpu

interpret_without_gpu("roofline.model_executor.layers.quantization.fp8_triton", "_w8a8_block_kernel")
pytest.importorskip("triton")

from roofline.model_executor.layers.quantization import fp8_triton as fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_FP8_DOT = DEVICE == "cpu" or fp8.has_fp8_tensor_cores(torch.device(DEVICE))
needs_fp8_dot = pytest.mark.skipif(not HAS_FP8_DOT, reason="the w8a8 GEMM needs FP8 tensor cores (sm >= 8.9)")
# w8a8 against the exact product of the dequantised operands: the interpreter is exact in fp32; Hopper's
# FP8 tensor cores add one K tile's products with a ~14-bit mantissa (fp32 only between K tiles).
W8A8_REL = 1e-5 if DEVICE == "cpu" else 1e-3


def _weights(n, k, block_k, scale_rows, seed):
    """Random e4m3 bytes over every finite encoding (subnormals, both zeros included) and positive block
    scales -> (w_q uint8 [n, k], w_s [ceil(n/scale_rows), ceil(k/block_k)])."""
    g = torch.Generator().manual_seed(seed)
    w_q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    w_q[(w_q & 0x7F) == 0x7F] = 0x3C  # no NaN
    w_s = torch.rand(-(-n // scale_rows), -(-k // block_k), generator=g) * 2e-3 + 1e-4
    return w_q, w_s


def _x(m, k, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g) * spread)


def _assert_close_rel(got, expected, rel):
    """max |got - expected| <= rel * max |expected| (errors measured against the output's magnitude)."""
    err = (got.double().cpu() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} * {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,group", [(1, 128, 128), (5, 192, 128), (2, 300, 128), (3, 100, 32)])
def test_group_quant_matches_reference(m, k, group, dtype):
    x = (_x(m, k, seed=m * k, spread=3.0) * 10).clamp(-6e4, 6e4).to(dtype)
    x[0, : min(group, k)] = 0  # an all-zero group gets the floor scale
    if m > 1:
        x[1, :7] = torch.tensor([447.9, -448.0, 1.96, -7.88, 1e-3, -1.6e-3, 0.0137])
    x_q, x_s = fp8.per_token_group_quant_fp8(x.to(DEVICE), group)
    ref_q, ref_s = fp8.per_token_group_quant_fp8_ref(x, group)
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == (m, k)
    assert x_s.dtype == torch.float32 and x_s.shape == (m, -(-k // group))
    assert torch.equal(x_s.cpu(), ref_s)
    assert torch.equal(x_q.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert x_s[0, 0].item() == pytest.approx(1e-10 / 448, rel=1e-6)


def test_group_quant_round_trip_is_close():
    x = _x(4, 256, seed=3)
    x_q, x_s = fp8.per_token_group_quant_fp8(x.to(DEVICE), 128)
    back = x_q.float().cpu() * x_s.cpu().repeat_interleave(128, dim=1)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each group's amax
    _assert_close_rel(back, x, 2 ** -4)


@needs_fp8_dot
@pytest.mark.parametrize("m,n,k,block_k,scale_rows", [
    (1, 40, 192, 128, 16),   # partial last K block, N spans 3 scale rows and is not a multiple of BLOCK_N
    (5, 72, 576, 128, 1),    # kv_a-like K = 4.5 blocks, a scale row per weight row
    (5, 130, 256, 128, 128), # N spans 2 scale rows of DeepSeek's 128, EVEN_K
    (37, 24, 96, 32, 8),     # BLOCK_M 64, a smaller block_k
    (70, 136, 160, 32, 128), # two M tiles, BLOCK_N 128
])
def test_w8a8_matches_fp64_reference(m, n, k, block_k, scale_rows):
    x = _x(m, k, seed=n + k)
    w_q, w_s = _weights(n, k, block_k, scale_rows, seed=m + n)
    x_q, x_s = fp8.per_token_group_quant_fp8(x.to(DEVICE), block_k)
    got = fp8.w8a8_block_fp8_matmul(x_q, x_s, w_q.view(torch.float8_e4m3fn).to(DEVICE), w_s.to(DEVICE),
                                    block_k, scale_rows, torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    x_deq = x_q.cpu().double() * x_s.cpu().double().repeat_interleave(block_k, dim=1)[:, :k]
    expected = x_deq @ fp8.dequantize_block_fp8(w_q, w_s, block_k, scale_rows).double().T
    _assert_close_rel(got, expected, W8A8_REL)


@pytest.mark.parametrize("m,n,k,block_k,scale_rows", [
    (1, 40, 192, 128, 16),
    (5, 72, 576, 128, 1),
    (5, 130, 256, 128, 128),
    (37, 24, 96, 32, 8),
    (70, 136, 160, 32, 128),
])
def test_weight_only_matches_linear_on_dequantized_weight(m, n, k, block_k, scale_rows):
    x = _x(m, k, seed=n * k)
    w_q, w_s = _weights(n, k, block_k, scale_rows, seed=m * n)
    got = fp8.weight_only_block_fp8_matmul(x.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), block_k, scale_rows)
    assert got.shape == (m, n) and got.dtype == torch.float32
    expected = F.linear(x.double(), fp8.dequantize_block_fp8(w_q, w_s, block_k, scale_rows).double())
    _assert_close_rel(got, expected, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_only_half_precision(dtype):
    x = _x(5, 192, seed=1).to(dtype)
    w_q, w_s = _weights(40, 192, 128, 16, seed=2)
    got = fp8.weight_only_block_fp8_matmul(x.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), 128, 16)
    assert got.dtype == dtype
    expected = F.linear(x.double(), fp8.dequantize_block_fp8(w_q, w_s, 128, 16).double())
    _assert_close_rel(got, expected, 1e-2)


@pytest.mark.parametrize("mode", ["weight_only", pytest.param("w8a8", marks=needs_fp8_dot), "auto"])
def test_block_fp8_linear_3d_input_and_bias(mode):
    x = _x(6, 192, seed=7).view(2, 3, 192)
    w_q, w_s = _weights(40, 192, 128, 16, seed=8)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(9))
    got = fp8.block_fp8_linear(x.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), 128, 16, bias=bias.to(DEVICE), mode=mode)
    assert got.shape == (2, 3, 40) and got.dtype == torch.float32
    w = fp8.dequantize_block_fp8(w_q, w_s, 128, 16).double()
    expected = F.linear(x.double(), w, bias.double())
    if mode == "auto":
        mode = "w8a8" if fp8.has_fp8_tensor_cores(torch.device(DEVICE)) else "weight_only"
    # w8a8 also rounds the activations to e4m3 (3 mantissa bits): a few percent of the output's range
    _assert_close_rel(got, expected, 1e-5 if mode == "weight_only" else 5e-2)
    if mode == "w8a8":
        x_q, x_s = fp8.per_token_group_quant_fp8_ref(x.view(6, 192), 128)
        x_deq = x_q.double() * x_s.double().repeat_interleave(128, dim=1)[:, :192]
        _assert_close_rel(got.view(6, 40), F.linear(x_deq, w, bias.double()), W8A8_REL)


def test_auto_mode_picks_by_device(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8, "w8a8_block_fp8_matmul", lambda *a, **k: calls.append("w8a8") or torch.zeros(1, 8))
    monkeypatch.setattr(fp8, "weight_only_block_fp8_matmul",
                        lambda *a, **k: calls.append("weight_only") or torch.zeros(1, 8))
    w_q, w_s = _weights(8, 128, 128, 128, seed=0)
    fp8.block_fp8_linear(torch.randn(1, 128), w_q, w_s, 128, 128)
    assert calls == ["weight_only"]  # CPU tensors never take the fp8 GEMM
    if torch.cuda.is_available():
        fp8.block_fp8_linear(torch.randn(1, 128, device="cuda"), w_q.cuda(), w_s.cuda(), 128, 128)
        assert calls[-1] == ("w8a8" if fp8.has_fp8_tensor_cores(torch.device("cuda")) else "weight_only")


@pytest.mark.parametrize("mode", ["weight_only", pytest.param("w8a8", marks=needs_fp8_dot)])
def test_uint8_and_e4m3_weights_agree(mode):
    x = _x(5, 192, seed=11)
    w_q, w_s = _weights(40, 192, 128, 16, seed=12)
    args = (w_s.to(DEVICE), 128, 16)
    a = fp8.block_fp8_linear(x.to(DEVICE), w_q.to(DEVICE), *args, mode=mode)
    b = fp8.block_fp8_linear(x.to(DEVICE), w_q.view(torch.float8_e4m3fn).to(DEVICE), *args, mode=mode)
    assert torch.equal(a, b)


def test_dequantize_block_fp8():
    w_q = torch.tensor([[0x38, 0xB8, 0x01], [0x7E, 0x00, 0x40], [0x38, 0x38, 0x38]], dtype=torch.uint8)
    w_s = torch.tensor([[2.0, 3.0], [0.5, 0.25]])
    w = fp8.dequantize_block_fp8(w_q, w_s, 2, 2)
    assert w.dtype == torch.float32 and w.shape == (3, 3)
    assert w.tolist() == [[2.0, -2.0, 2 ** -9 * 3.0], [896.0, 0.0, 6.0], [0.5, 0.5, 0.25]]


def test_shape_checks():
    w_q, w_s = _weights(40, 192, 128, 16, seed=0)
    with pytest.raises(AssertionError):
        fp8.weight_only_block_fp8_matmul(torch.randn(2, 192), w_q, w_s[:2], 128, 16)
    with pytest.raises(AssertionError):
        fp8.block_fp8_linear(torch.randn(2, 192), w_q, w_s, 128, 16, mode="int8")
