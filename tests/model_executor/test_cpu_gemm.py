"""Pre-packed oneDNN CPU weights (cpu_gemm): same products as F.linear on the dense weights."""

import pytest
import torch
import torch.nn.functional as F

from roofline.model_executor.layers import cpu_gemm
from roofline.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from roofline.model_executor.layers.vocab_embedding import ParallelLMHead

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 37, 64, 300, 1024])
def test_packed_linear_matches_dense(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g)
    x = torch.randn(rows, 40, generator=g)
    got = cpu_gemm.packed_linear(x, cpu_gemm.pack(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_which_batches_take_the_packed_weight():
    assert not cpu_gemm.use_packed(torch.empty(1, 8))  # GEMV: the dense [in x out] weight is faster
    assert cpu_gemm.use_packed(torch.empty(2, 8)) and cpu_gemm.use_packed(torch.empty(1023, 8))
    assert not cpu_gemm.use_packed(torch.empty(cpu_gemm.PACKED_MAX_ROWS, 8))


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
    assert cpu_gemm.pack_model(model) == 3
    assert all(m.cpu_packed is not None for m in model.values())
    got = (model["qkv"](x), model["o"](x), model["head"].compute_logits(x))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # one row still goes through the dense weight: the same values again
    torch.testing.assert_close(model["qkv"](x[:1]), expected[0][:1], atol=1e-5, rtol=1e-5)


def test_non_fp32_weights_are_left_alone():
    lin = RowParallelLinear(16, 8, dtype=torch.bfloat16)
    assert cpu_gemm.pack_model(lin) == 0 and lin.cpu_packed is None
