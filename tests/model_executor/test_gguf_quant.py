"""GGUF block-quantized weights computed natively (gguf_quant, quant_kernels.c): every format's values
exactly gguf's dequantization, and its GEMV / GEMM the fp32 products over those values."""

import gguf
import pytest
import torch
import torch.nn.functional as F

from roofline.cpu import gemm as cpu_gemm, ops as cpu_ops, gguf_quant
from roofline.cpu.gguf_quant import FORMATS, QuantizedTensor
from tests.reference.isa_builds import each_vector_build
from tests.reference.quantized import q8_emulation, random_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable (no C compiler)")

def reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def test_format_table_matches_gguf_and_the_kernels():
    lib = cpu_ops.library()
    for qtype, (name, qk, bb) in FORMATS.items():
        assert gguf.GGMLQuantizationType(qtype).name == name
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)] == (qk, bb)
        assert (lib.quant_block_elems(qtype), lib.quant_block_bytes(qtype)) == (qk, bb)
    assert lib.quant_block_bytes(1) == 0  # F16: not a block format the kernels take


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_expansion_is_exactly_gguf_dequantize(qtype):
    w = random_blocks(qtype, 37, 512, seed=qtype)
    want = w.dequantize()
    got = gguf_quant.dequantize_native(w)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, signed zeros included


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gemv_expands_exact_values(qtype, threads):
    """One-hot rows pick single columns out of the GEMV's own expansion: x . w with one nonzero 1.0 is
    exactly that weight value, so any rounding difference in the fused expansion shows."""
    cols = 512
    w = random_blocks(qtype, 45, cols, seed=100 + qtype)
    want = w.dequantize()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k in (0, 1, 15, 16, 31, 33, 255, 256, 300, cols - 1):
            x = torch.zeros(1, cols)
            x[0, k] = 1.0
            got = gguf_quant.linear(x, w)
            assert torch.equal(got[0], want[:, k]), f"column {k}"
    finally:
        torch.set_num_threads(before)


# cols: one block, several blocks (and for the 256-value formats one and three super-blocks);
# rows (outputs): a panel, a zero-padded last panel, an odd count
@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("rows,cols", [(16, 256), (7, 768), (53, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_fp32_matmul(qtype, rows, cols, with_bias):
    g = torch.Generator().manual_seed(rows + cols + qtype)
    w = random_blocks(qtype, rows, cols, seed=rows * cols + qtype)
    x = torch.randn(1, cols, generator=g)
    b = torch.randn(rows, generator=g) if with_bias else None
    torch.testing.assert_close(gguf_quant.linear(x, w, b), reference(x, w.dequantize(), b), atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gemv_result_does_not_depend_on_the_thread_count(threads):
    w = random_blocks(3, 100, 1024, seed=5)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_quant.linear(x, w)
        torch.set_num_threads(threads)
        assert torch.equal(gguf_quant.linear(x, w), one)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("m", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cols", [512, 2048])  # 2048: more than four rows go as two calls of two weight rows
def test_a_few_rows_are_the_one_row_gemv_bit_for_bit(qtype, m, threads, cols):
    """2..8 rows (a decode verifying drafts, a few decodes): each weight row decoded once for all of
    them, and every row's values exactly the one-row GEMV's (so a verified draft's logits are a plain
    decode's)."""
    rows = 53
    g = torch.Generator().manual_seed(m * 7 + qtype)
    w = random_blocks(qtype, rows, cols, seed=m * 3 + qtype)
    x = torch.randn(m, cols, generator=g)
    b = torch.randn(rows, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gguf_quant.linear(x, w, b)
        one_by_one = torch.cat([gguf_quant.linear(x[i:i + 1], w, b) for i in range(m)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, one_by_one)
    torch.testing.assert_close(got, reference(x, w.dequantize(), b), atol=5e-4, rtol=1e-4)


# M: past the few-rows route (up to 8 rows), uneven tiles, one row block, one more (panel groups), many
@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("m", [9, 13, 32, 33, 96, 97, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_is_the_packed_gemm_over_the_dequantized_weight(qtype, m, threads):
    """More than 8 rows: bit-identical to cpu_ops.gemm_packed over gguf's dequantized weight."""
    rows, cols = 53, 512  # 53 outputs: four panels, the last zero padded
    g = torch.Generator().manual_seed(m * 10 + qtype)
    w = random_blocks(qtype, rows, cols, seed=m + qtype)
    x = torch.randn(m, cols, generator=g)
    b = torch.randn(rows, generator=g)
    dense = w.dequantize()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gguf_quant.linear(x, w, b)
        assert not gguf_quant.rows_route(qtype, m)
        want = cpu_ops.gemm_packed(x, cpu_gemm.pack(dense), rows, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, reference(x, dense, b), atol=5e-4, rtol=1e-4)


# M: the rows routes (1, 8), past them, one row block, one more (panel groups); d: 3 panels per half, and
# 40 (a partial last panel in each half)
@pytest.mark.parametrize("qtype", sorted(FORMATS))
@pytest.mark.parametrize("m", [1, 8, 9, 33, 97, 200])
@pytest.mark.parametrize("d", [48, 40])
@pytest.mark.parametrize("threads", [1, 2])
def test_gate_up_with_silu_is_the_projection_then_silu_and_mul(qtype, m, d, threads):
    """linear_silu_mul over [W_g; W_u]: bit-identical to the projection followed by SiluAndMul in every
    route, the packed GEMM's one with its fused epilogue included."""
    cols = 512
    g = torch.Generator().manual_seed(m * 7 + qtype + d)
    w = random_blocks(qtype, 2 * d, cols, seed=m + qtype + d)
    x = torch.randn(m, cols + 24, generator=g)[:, 24:]  # rows cols + 24 floats apart
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gguf_quant.linear_silu_mul(x, w)
        want = cpu_ops.silu_and_mul(gguf_quant.linear(x.contiguous(), w))
    finally:
        torch.set_num_threads(before)
    assert got.shape == (m, d)
    assert torch.equal(got, want)
    h = reference(x, w.dequantize())
    want = F.silu(h[:, :d]) * h[:, d:]
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-3)  # products of two sums


@pytest.mark.parametrize("qtype", [3, 12])  # Q4_1, Q4_K
def test_routes_alike_knows_the_quantized_routes(qtype):
    """cpu_gemm.routes_alike with a block weight's kernel type says yes only where a batch's kept rows
    come out the same bits as in the whole batch (LlamaModel shrinks the last layer to the rows it keeps
    on that word), and no across the GEMV / GEMM boundary."""
    rows, cols = 37, 512
    w = random_blocks(qtype, rows, cols, seed=300 + qtype)
    x = torch.randn(48, cols, generator=torch.Generator().manual_seed(qtype))
    said = {}
    for a, b in [(5, 3), (8, 2), (9, 3), (20, 6), (32, 8), (33, 8), (48, 6), (48, 40)]:
        said[a, b] = cpu_gemm.routes_alike(a, b, [w])
        if said[a, b]:
            torch.testing.assert_close(gguf_quant.linear(x[a - b:a], w), gguf_quant.linear(x[:a], w)[a - b:],
                                       atol=0, rtol=0)
    assert said[5, 3] and said[8, 2] and said[48, 40]  # in any build: the GEMV routes up to 8 rows
    assert not (said[9, 3] or said[20, 6] or said[32, 8] or said[33, 8] or said[48, 6])
    assert not cpu_gemm.routes_alike(2, 1) and cpu_gemm.routes_alike(48, 6)  # fp32 alone: GEMV vs packed
    w.quantize_activations = True  # q8 mode: one route for any rows
    assert cpu_gemm.routes_alike(48, 6, [w]) == (qtype in gguf_quant.ACT_Q8_FORMATS)


def test_gemm_reads_strided_rows():
    w = random_blocks(3, 40, 256, seed=9)
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(9))[:, 20:276]  # rows 300 floats apart
    torch.testing.assert_close(gguf_quant.linear(x, w), reference(x, w.dequantize()), atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", [2, 3, 8])  # the formats with hand-vectorized GEMVs: Q4_0, Q4_1, Q8_0
def test_every_vector_build_gives_the_gemvs_the_same_values(qtype):
    """The AVX2 build (eight lanes, up to six rows at a time in passes over a block's groups) and the AVX-512
    build (sixteen lanes, every row in one pass): for 1..8 rows each row's values are the one-row GEMV's, and the two builds agree bit
    for bit -- the same products in the same order -- so --cpu-isa never changes a token."""
    rows, cols = 37, 768
    g = torch.Generator().manual_seed(qtype)
    w = random_blocks(qtype, rows, cols, seed=17 + qtype)
    x = torch.randn(8, cols, generator=g)
    results = {}
    for isa in each_vector_build():
        one_by_one = torch.cat([gguf_quant.linear(x[i:i + 1], w) for i in range(8)])
        for m in range(1, 9):
            assert torch.equal(gguf_quant.linear(x[:m], w), one_by_one[:m]), (isa, m)
        results[isa] = one_by_one
    builds = list(results)
    for isa in builds[1:]:
        assert torch.equal(results[isa], results[builds[0]]), (isa, builds[0])
    torch.testing.assert_close(results[builds[0]], reference(x, w.dequantize()), atol=5e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", sorted(FORMATS))
def test_portable_build_gives_the_same_values(portable_kernels, qtype):
    """The plain C build (no AVX2: other CPUs, aarch64): the same exact expansion and fp32 products."""
    rows, cols = 21, 512
    w = random_blocks(qtype, rows, cols, seed=200 + qtype)
    want = w.dequantize()
    out = torch.empty(rows, cols)
    portable_kernels.quant_dequantize_f32(qtype, w.data.data_ptr(), w.data.shape[1], rows, cols, out.data_ptr(), 2)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    for m in (1, 4, 100):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        y = torch.empty(m, rows)
        portable_kernels.quant_linear_f32(qtype, x.data_ptr(), cols, w.data.data_ptr(), w.data.shape[1], None,
                                          y.data_ptr(), rows, m, cols, rows, 2)
        torch.testing.assert_close(y, reference(x, want), atol=5e-4, rtol=1e-4)
    gate_up = random_blocks(qtype, 32, cols, seed=300 + qtype)  # d = 16: the fused route past 8 rows
    for m in (4, 100):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        y = torch.empty(m, 16)
        portable_kernels.quant_linear_silu_mul_f32(qtype, x.data_ptr(), cols, gate_up.data.data_ptr(),
                                                   gate_up.data.shape[1], y.data_ptr(), 16, m, cols, 16, 2)
        h = reference(x, gate_up.dequantize())
        fused = F.silu(h[:, :16]) * h[:, 16:]
        torch.testing.assert_close(y, fused, atol=1e-4 * fused.abs().max().item(), rtol=1e-3)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        gguf_quant.row_bytes(3, 40)
    with pytest.raises(ValueError, match="bytes"):
        QuantizedTensor(torch.zeros(4, 19, dtype=torch.uint8), 3, 32)
    with pytest.raises(ValueError, match="not a format"):
        QuantizedTensor(torch.zeros(4, 19, dtype=torch.uint8), 1, 32)
    w = random_blocks(3, 8, 64, seed=0)
    with pytest.raises(ValueError, match="fp32 CPU rows"):
        gguf_quant.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="fp32 CPU rows"):
        gguf_quant.linear(torch.randn(2, 64, dtype=torch.float64), w)



ACT_Q8_FORMATS = sorted(gguf_quant.ACT_Q8_FORMATS)


@pytest.mark.parametrize("qtype", ACT_Q8_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 70])
def test_q8_activations_are_the_exact_q8_emulation(qtype, m):
    """Integer dot products: equal to the emulation up to fp32 summation order; every row the same
    whatever the number of rows; within ~1% of the fp32 path.  (37 rows: two interleaved groups of 16 and
    five rows in the file's layout.)"""
    rows, cols = 37, 512
    g = torch.Generator().manual_seed(qtype * 11 + m)
    w = random_blocks(qtype, rows, cols, seed=qtype + 40 * m)
    x = torch.randn(m, cols, generator=g) * torch.rand(m, cols // 32, 1, generator=g).repeat(1, 1, 32).reshape(m, cols)
    b = torch.randn(rows, generator=g)
    exact = gguf_quant.linear(x, w, b)
    w.quantize_activations = True
    got = gguf_quant.linear(x, w, b)
    torch.testing.assert_close(got, q8_emulation(x, w, b), atol=2e-4, rtol=1e-5)
    assert not torch.equal(got, exact)  # the activations really were rounded
    torch.testing.assert_close(got, exact, atol=0.02 * exact.abs().max().item(), rtol=0.02)
    one_by_one = torch.cat([gguf_quant.linear(x[i:i + 1], w, b) for i in range(m)])
    assert torch.equal(got, one_by_one)


def test_q8_activations_leave_the_k_quants_exact():
    """The K-quants have no integer route: they stay on fp32 activations."""
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(3))
    for m in (1, 3, 12):
        w = random_blocks(12, 20, 512, seed=12)
        exact = gguf_quant.linear(x[:m], w)
        w.quantize_activations = True
        assert torch.equal(gguf_quant.linear(x[:m], w), exact)


def test_q8_activations_are_one_sum_in_every_build(portable_kernels):
    """The integer sums are exact and each row's fp32 sum over the blocks has one order, so the AVX-512
    (vpdpbusd), AVX2 (vpmaddubsw) and plain C builds give the same values bit for bit -- in the interleaved
    groups and in the rows past the last group (45 = two groups of 16 and 13 more) -- for any rows."""
    rows, cols = 45, 512
    for qtype in ACT_Q8_FORMATS:
        w = random_blocks(qtype, rows, cols, seed=300 + qtype)
        w.quantize_activations = True
        g = torch.Generator().manual_seed(qtype)
        x = torch.randn(11, cols, generator=g) * torch.rand(11, cols // 32, 1, generator=g).repeat(1, 1, 32).reshape(11, cols)
        b = torch.randn(rows, generator=g)
        want = torch.empty(11, rows)
        portable_kernels.quant_linear_f32(w.kernel_type, x.data_ptr(), cols, w.data.data_ptr(), w.data.shape[1],
                                          b.data_ptr(), want.data_ptr(), rows, 11, cols, rows, 2)
        torch.testing.assert_close(want, q8_emulation(x, w, b), atol=2e-4, rtol=1e-5)
        for isa in each_vector_build():
            for m in (1, 4, 9, 11):
                assert torch.equal(gguf_quant.linear(x[:m], w, b), want[:m]), (isa, qtype, m)


@pytest.mark.parametrize("qtype", ACT_Q8_FORMATS)
@pytest.mark.parametrize("rows", [16, 37, 5])
def test_the_q8_layout_is_the_same_bytes_reordered(qtype, rows):
    """quantize_activations re-lays the blocks in place (16 rows interleaved, rows past the last group as
    they were) and clearing it restores the file's bytes; dequantize() reads through either layout."""
    w = random_blocks(qtype, rows, 256, seed=qtype + rows)
    raw, values = w.data.clone(), w.dequantize()
    ptr = w.data.data_ptr()
    w.quantize_activations = True
    assert w.data.data_ptr() == ptr and w.data.shape == raw.shape
    assert torch.equal(w.data[rows // 16 * 16:], raw[rows // 16 * 16:])
    assert rows < 16 or not torch.equal(w.data, raw)
    assert torch.equal(w.data.flatten().sort().values, raw.flatten().sort().values) or qtype == 8  # Q8_0: + 128
    assert torch.equal(w.dequantize(), values) and torch.equal(gguf_quant.dequantize_native(w), values)
    w.quantize_activations = False
    assert torch.equal(w.data, raw)
