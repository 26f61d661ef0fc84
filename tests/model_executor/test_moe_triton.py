"""The Triton grouped-GEMM MoE kernel (roofline/model_executor/layers/moe/triton_moe.py) against the
torch reference expert compute; without a GPU through the Triton interpreter on CPU tensors
(TRITON_INTERPRET=1 set before the kernel is defined, as in test_triton_ops.py)."""

import pytest
import torch

from tests.triton_interpreter import interpret_without_gpu

interpret_without_gpu("roofline.model_executor.layers.moe.triton_moe", "_grouped_gemm_kernel")
pytest.importorskip("triton")

from roofline.model_executor.layers.moe import RoutingConfig, select_experts  # noqa: E402
from roofline.model_executor.layers.moe import triton_moe  # noqa: E402
from roofline.model_executor.layers.moe.torch_experts import torch_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_align_by_expert_blocks_hold_one_expert():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (13, 2), generator=g)
    rows, block_expert = triton_moe.align_by_expert(ids, 6, 4)
    nk = ids.numel()
    assert rows.shape[0] % 4 == 0 and rows.shape[0] == block_expert.shape[0] * 4
    real = rows[rows < nk].long()
    assert sorted(real.tolist()) == list(range(nk))  # every (token, slot) exactly once
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        block = rows[4 * b:4 * b + 4].long()
        block = block[block < nk]
        if e < 0:
            assert block.numel() == 0
        else:
            assert block.numel() > 0 and (flat[block] == e).all()
    assert (block_expert[block_expert >= 0].diff() >= 0).all()


@pytest.mark.parametrize("n,k,e,inter,hidden", [(1, 2, 4, 32, 64), (7, 2, 8, 48, 64), (33, 3, 5, 40, 80)])
def test_triton_experts_match_reference(n, k, e, inter, hidden):
    g = torch.Generator().manual_seed(n)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(e, hidden, inter, generator=g) * 0.2
    x = torch.randn(n, hidden, generator=g)
    weights, ids = select_experts(torch.randn(n, e, generator=g), RoutingConfig(top_k=k, renormalize=True))
    expected = torch_experts(x, w13, w2, weights, ids)
    got = triton_moe.triton_experts(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)


def test_triton_experts_with_biases_and_the_clamped_swiglu_match_reference():
    """gpt-oss's experts: biases on both projections and the clamped SwiGLU, applied between the launches."""
    from roofline.model_executor.layers.moe.torch_experts import ExpertActivation

    n, k, e, inter, hidden = 9, 2, 4, 32, 64
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * 0.3
    w2 = torch.randn(e, hidden, inter, generator=g) * 0.2
    b13, b2 = torch.randn(e, 2 * inter, generator=g), torch.randn(e, hidden, generator=g)
    x = torch.randn(n, hidden, generator=g)
    weights, ids = select_experts(torch.randn(n, e, generator=g), RoutingConfig(top_k=k, scoring="topk_softmax"))
    act = ExpertActivation("clamped_swiglu", alpha=1.702, limit=1.5)
    expected = torch_experts(x, w13, w2, weights, ids, act, b13, b2)
    assert not torch.allclose(expected, torch_experts(x, w13, w2, weights, ids, act, b13, None))  # b2 counts
    got = triton_moe.triton_experts(*(t.to(DEVICE) for t in (x, w13, w2, weights, ids)), activation=act,
                                    b13=b13.to(DEVICE), b2=b2.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-4, atol=1e-4)
