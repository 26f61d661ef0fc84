"""The CPU KV pool's allocation: zeroed, right shape, huge pages only as advice."""

import torch

from roofline.worker.worker import zeros_on_huge_pages


def test_zeros_on_huge_pages_is_a_zeroed_tensor():
    for shape in [(2, 4, 16, 3, 64), (2, 400, 16, 3, 64)]:  # below and above the 2-huge-page threshold
        t = zeros_on_huge_pages(shape, torch.float32)
        assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
        assert not t.any()
        t[1, -1] = 1.0  # writable to the end
        assert t.sum().item() == t[1, -1].numel()
