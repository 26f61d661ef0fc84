"""The CPU KV pool's allocation: zeroed, right shape, huge pages only as advice."""

import os

import torch

from roofline.worker.worker import zeros_on_huge_pages


def test_zeros_on_huge_pages_is_a_zeroed_tensor():
    for shape in [(2, 4, 16, 3, 64), (2, 400, 16, 3, 64)]:  # below and above the 2-huge-page threshold
        t = zeros_on_huge_pages(shape, torch.float32)
        assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
        assert not t.any()
        t[1, -1] = 1.0  # writable to the end
        assert t.sum().item() == t[1, -1].numel()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_large_pool_is_neither_zeroed_nor_resident_until_used():
    """The pool's pages come zeroed from the kernel on first touch: allocating 512 MiB takes no resident
    memory, writing one block makes only its pages resident, and the mapping starts on a huge page."""
    before = _resident_bytes()
    t = zeros_on_huge_pages((1024, 2, 16, 4, 256), torch.float32)  # 512 MiB
    assert t.data_ptr() % (2 << 20) == 0
    assert _resident_bytes() - before < (32 << 20)
    t[7] = 1.0  # one block: 128 KiB (at most one huge page)
    assert _resident_bytes() - before < (32 << 20)
    assert not t[8:].any() and not t[:7].any() and t[7].all()
    del t
