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


def _huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of the mappings that overlap [lo, hi), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and lo < b
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


def test_weights_onto_huge_pages_keeps_the_values():
    import sys

    from roofline.worker.worker import HUGE_PAGE_WEIGHTS, weights_onto_huge_pages

    w = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB: its own anonymous mapping
    expected = w.clone()
    with HUGE_PAGE_WEIGHTS.forced(False):
        assert weights_onto_huge_pages() == 0
    moved = weights_onto_huge_pages()
    assert torch.equal(w, expected)
    if not sys.platform.startswith("linux") or not _has_madv_collapse():
        assert moved == 0
        return
    assert moved >= 60 << 20  # at least this tensor's whole 2 MiB pages
    assert _huge_kib(w.data_ptr(), w.data_ptr() + w.numel() * 4) >= 60 << 10


def _has_madv_collapse() -> bool:
    """Linux 6.1+ with transparent huge pages built in: where MADV_COLLAPSE exists."""
    import os
    import platform

    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1) and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
