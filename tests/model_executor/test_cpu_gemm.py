"""Natively packed CPU weights (cpu_gemm, cpu_ops.gemm_packed): same products as F.linear."""

import pytest
import torch
import torch.nn.functional as F

from roofline.cpu import gemm as cpu_gemm, ops as cpu_ops
from roofline.model_executor.layers import cpu_prepare
from roofline.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from roofline.model_executor.layers.vocab_embedding import ParallelLMHead

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="native CPU kernels unavailable (no C compiler)")


def reference(x, w, b=None):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


# rows: 1..6 (one partial tile), 7/13/37 (uneven tiles), 96/97 (one row block and one more), many blocks
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 37, 64, 96, 97, 200, 2048])
@pytest.mark.parametrize("out_features", [96, 40, 7])  # 40, 7: a zero-padded last panel
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_gemm_matches_dense(rows, out_features, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, 40, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)
    got = cpu_ops.gemm_packed(x, cpu_gemm.pack(w), w.shape[0], b)
    torch.testing.assert_close(got, reference(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_packed_gemm_threads_and_panel_groups(threads):
    """Enough panels for several groups per thread, and a row count spanning three row blocks."""
    g = torch.Generator().manual_seed(threads)
    w = torch.randn(16 * 37 + 5, 24, generator=g)
    x = torch.randn(250, 24, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.gemm_packed(x, cpu_gemm.pack(w), w.shape[0])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, reference(x, w), atol=1e-5, rtol=1e-5)


def test_packed_gemm_reads_strided_rows_and_any_weight_layout():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 64, generator=g).t().contiguous().t()  # [in x out]-major, as after relayout
    x = torch.randn(9, 100, generator=g)[:, 10:74]  # rows 100 floats apart
    torch.testing.assert_close(cpu_ops.gemm_packed(x, cpu_gemm.pack(w), w.shape[0]), reference(x, w), atol=1e-5, rtol=1e-5)


def test_panels_must_fit_the_weight():
    w = torch.randn(32, 16)
    with pytest.raises(ValueError, match="panels"):
        cpu_ops.gemm_packed(torch.randn(4, 8), cpu_gemm.pack(w), 32)


def test_which_batches_take_the_packed_weight():
    assert not cpu_gemm.use_packed(torch.empty(1, 8))  # GEMV: the dense [in x out] weight is faster
    assert cpu_gemm.use_packed(torch.empty(2, 8)) and cpu_gemm.use_packed(torch.empty(4096, 8))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_single_row_takes_the_native_gemv_over_the_dense_weight(threads):
    """Whatever the thread count (the layer stack takes the same route for a lone row)."""
    g = torch.Generator().manual_seed(threads)
    w = torch.randn(40, 24, generator=g).t().contiguous().t()  # [in x out]-major, as cpu_prepare.relayout stores it
    b = torch.randn(40, generator=g)
    x = torch.randn(1, 24, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, native = cpu_gemm.linear(x, w, cpu_gemm.pack(w), b), cpu_ops.gemv(x, w, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, native)
    torch.testing.assert_close(got, reference(x, w, b), atol=1e-5, rtol=1e-5)


def test_pack_model_layers_give_the_dense_results():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "qkv": QKVParallelLinear(48, 16, 3, 1, bias=True),
        "o": RowParallelLinear(48, 48, bias=True),
        "head": ParallelLMHead(200, 48),
    })
    for p in model.parameters():
        p.data.normal_()
    x = torch.randn(9, 48)
    expected = (model["qkv"](x), model["o"](x), model["head"].compute_logits(x))
    assert cpu_prepare.pack_model(model) == 3
    assert all(m.cpu_packed is not None for m in model.values())
    got = (model["qkv"](x), model["o"](x), model["head"].compute_logits(x))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # one row still goes through the dense weight: the same values again
    torch.testing.assert_close(model["qkv"](x[:1]), expected[0][:1], atol=1e-5, rtol=1e-5)


def test_relayout_keeps_an_untied_embeddings_rows():
    """Projections and the LM head go [in x out]-major; an input embedding keeps its rows unless the head
    shares its weight (then the shared weight goes [in x out]-major once); values unchanged."""
    from roofline.model_executor.layers.vocab_embedding import VocabParallelEmbedding

    for tied in (False, True):
        model = torch.nn.ModuleDict({"embed": VocabParallelEmbedding(200, 48), "o": RowParallelLinear(48, 48),
                                     "head": ParallelLMHead(200, 48)})
        for p in model.parameters():
            p.data.normal_()
        if tied:
            model["head"].weight = model["embed"].weight
        ids = torch.tensor([3, 199, 0])
        before = (model["embed"](ids), model["o"].weight.clone(), model["head"].weight.clone())
        cpu_prepare.relayout(model)
        assert model["o"].weight.stride() == (1, 48) and model["head"].weight.stride() == (1, 200)
        assert model["embed"].weight.stride() == ((1, 200) if tied else (48, 1))
        assert torch.equal(model["embed"](ids), before[0])
        assert torch.equal(model["o"].weight, before[1]) and torch.equal(model["head"].weight, before[2])


def test_non_fp32_weights_are_left_alone():
    lin = RowParallelLinear(16, 8, dtype=torch.bfloat16)
    assert cpu_prepare.pack_model(lin) == 0 and lin.cpu_packed is None


@pytest.mark.parametrize("rows", [1, 2, 7, 37, 97, 300])
@pytest.mark.parametrize("d,k", [(16, 12), (48, 40), (1536, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gate_up_silu_fused_equals_the_two_steps(rows, d, k, threads):
    """gemm_packed_silu_mul gives bit for bit what gemm_packed followed by silu_and_mul gives."""
    g = torch.Generator().manual_seed(rows + d)
    w = torch.randn(2 * d, k, generator=g)
    x = (torch.randn(rows, k + 3, generator=g) * k**-0.5)[:, :k]  # strided rows, products of order 1
    panels = cpu_gemm.pack(w)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.gemm_packed_silu_mul(x, panels, d)
        two_steps = cpu_ops.silu_and_mul(cpu_ops.gemm_packed(x, panels, 2 * d))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, two_steps)
    h = reference(x, w)
    torch.testing.assert_close(got, F.silu(h[:, :d]) * h[:, d:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [2, 7, 13, 37, 96])
def test_a_rows_result_does_not_depend_on_the_batch(rows):
    """Decode-sized batches run K in chunks, prefill-sized ones whole panels: each row's products are
    summed in the same order either way, so its result is bit-identical in any batch."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(160, 576, generator=g)
    x = torch.randn(300, 576, generator=g)
    panels = cpu_gemm.pack(w)
    assert torch.equal(cpu_ops.gemm_packed(x[:rows], panels, 160), cpu_ops.gemm_packed(x, panels, 160)[:rows])
    assert torch.equal(cpu_ops.gemm_packed_silu_mul(x[:rows], panels, 80),
                       cpu_ops.gemm_packed_silu_mul(x, panels, 80)[:rows])


def test_gate_up_silu_applies_only_where_it_can():
    from roofline.model_executor.layers.linear import MergedColumnParallelLinear

    def layer(d, bias=False):
        lin = MergedColumnParallelLinear(8, [d, d], bias=bias)
        torch.nn.init.normal_(lin.weight)
        if bias:
            torch.nn.init.normal_(lin.bias)
        cpu_prepare.pack_model(lin)
        return lin

    x = torch.randn(4, 8)
    lin = layer(32)
    got = cpu_gemm.gate_up_silu(x, lin)
    h = reference(x, lin.weight)
    torch.testing.assert_close(got, F.silu(h[:, :32]) * h[:, 32:], atol=1e-5, rtol=1e-5)
    assert cpu_gemm.gate_up_silu(x[:1], lin) is None  # one row: the dense GEMV path
    assert cpu_gemm.gate_up_silu(x.double(), lin) is None
    assert cpu_gemm.gate_up_silu(x, layer(24)) is None  # halves not on panel boundaries
    assert cpu_gemm.gate_up_silu(x, layer(32, bias=True)) is None
    with pytest.raises(ValueError, match="gate/up weight"):
        cpu_ops.gemm_packed_silu_mul(x, lin.cpu_packed, 16)


def test_portable_build_without_simd_intrinsics(portable_kernels):
    """Built without -march=native (no AVX2: e.g. aarch64), the packed GEMM takes its plain C tile."""
    lib = portable_kernels
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(21, 12, generator=g), torch.randn(21, generator=g), torch.randn(11, 12, generator=g)
    wt = w.t().contiguous()
    panels = torch.empty(2 * 12 * 16)
    lib.pack_panels_f32(wt.data_ptr(), 12, 21, 21, panels.data_ptr())
    y = torch.empty(11, 21)
    lib.gemm_packed_f32(x.data_ptr(), 12, panels.data_ptr(), b.data_ptr(), y.data_ptr(), 21, 11, 12, 21, 2)
    torch.testing.assert_close(y, reference(x, w, b), atol=1e-5, rtol=1e-5)
    wgu = torch.randn(64, 12, generator=g)
    panels = torch.empty(4 * 12 * 16)
    wgu_t = wgu.t().contiguous()  # kept alive through the call
    lib.pack_panels_f32(wgu_t.data_ptr(), 12, 64, 64, panels.data_ptr())
    y = torch.empty(11, 32)
    lib.gemm_packed_silu_mul_f32(x.data_ptr(), 12, panels.data_ptr(), y.data_ptr(), 32, 11, 12, 32, 2)
    h = reference(x, wgu)
    torch.testing.assert_close(y, F.silu(h[:, :32]) * h[:, 32:], atol=1e-5, rtol=1e-5)
