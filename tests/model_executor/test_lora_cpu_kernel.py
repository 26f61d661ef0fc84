"""The native grouped LoRA shrink/expand (cpu/lora_kernels.c) against the torch reference (lora/ops.py):
slices on and off, ranks off the 4-rank blocks, odd row counts, strided rows, each vector build and the
portable one; a row's result depends on its own inputs only."""

from __future__ import annotations

import pytest
import torch

from roofline.cpu import ops as cpu_ops
from roofline.lora import ops
from roofline.lora.layers import LoRALayer, LoRAStepState
from roofline.lora.mapping import Slice, Target
from tests.reference.isa_builds import each_vector_build

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable")
RANKS = [8, 3, 5, 16]


def layer(in_features: int, sizes: list[int], max_rank: int = 16, seed: int = 0) -> LoRALayer:
    """Four slots of ranks RANKS, each with a different choice of slices present."""
    g = torch.Generator().manual_seed(seed)
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    target = Target("t", None, False, in_features, in_features, sum(sizes),
                    [Slice(i, n, off, n) for i, (off, n) in enumerate(zip(offs, sizes))])
    lay = LoRALayer(target, LoRAStepState(len(RANKS)), len(RANKS), max_rank, torch.float32, "cpu")
    for slot, r in enumerate(RANKS):
        on = [s == 0 or (slot + s) % 3 != 0 for s in range(len(sizes))]
        lay.load_slot(slot, (torch.randn(len(sizes), r, in_features, generator=g),
                             torch.randn(sum(sizes), r, generator=g), on))
        lay.state.ranks[slot] = r
    return lay


GROUPS = [(1, 3, 0, 5), (0, 8, 5, 6), (3, 16, 6, 19), (2, 5, 21, 40), (1, 3, 19, 21)]  # rows 40: gaps are the base's


@pytest.mark.parametrize("in_features,sizes", [(64, [64, 32, 32]), (200, [130]), (37, [5, 300]), (576, [1536, 1536])])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch(in_features, sizes, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    lay = layer(in_features, sizes)
    g = torch.Generator().manual_seed(1)
    x, y0 = torch.randn(40, in_features, generator=g), torch.randn(40, sum(sizes), generator=g)
    want = y0.clone()
    ops.add_lora_torch(x, want, lay, GROUPS)
    base_rows = [r for r in range(40) if not any(s <= r < e for _, _, s, e in GROUPS)]
    for _ in each_vector_build():  # AVX-512 and AVX2 where this CPU runs them
        got = y0.clone()
        ops.add_lora_native(x, got, lay, GROUPS)
        torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=1e-5)
        assert torch.equal(got[base_rows], y0[base_rows])  # base-model rows untouched


def test_strided_rows_and_the_portable_build(portable_kernels):
    lay = layer(48, [40, 24])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 64, generator=g)[:, :48]  # rows 64 apart
    y0 = torch.randn(20, 80, generator=g)[:, :64]
    groups = [(0, 8, 0, 7), (3, 16, 7, 20)]
    want = y0.clone()
    ops.add_lora_torch(x, want, lay, groups)
    for lib in (None, portable_kernels):
        got = y0.clone()
        ops.add_lora_native(x, got, lay, groups, lib=lib)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_a_row_depends_on_its_own_inputs_only():
    """The same row alone, at either end of a group or in another batch: the same bits."""
    lay = layer(96, [64, 48, 48])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 96, generator=g)
    full = torch.zeros(9, 160)
    ops.add_lora_native(x, full, lay, [(3, 16, 0, 9)])
    for i in range(9):
        alone = torch.zeros(1, 160)
        ops.add_lora_native(x[i:i + 1].contiguous(), alone, lay, [(3, 16, 0, 1)])
        assert torch.equal(alone[0], full[i])


def test_routes(monkeypatch):
    lay = layer(32, [32])
    calls = []
    monkeypatch.setattr(ops, "add_lora_native", lambda *a, **k: calls.append("native"))
    monkeypatch.setattr(ops, "add_lora_torch", lambda *a, **k: calls.append("torch"))
    ops.add_lora(torch.zeros(2, 32), torch.zeros(2, 32), lay, [(0, 8, 0, 2)])
    ops.add_lora(torch.zeros(2, 32, dtype=torch.float64), torch.zeros(2, 32, dtype=torch.float64), lay, [(0, 8, 0, 2)])
    with cpu_ops.forced(False):
        ops.add_lora(torch.zeros(2, 32), torch.zeros(2, 32), lay, [(0, 8, 0, 2)])
    assert calls == ["native", "torch", "torch"]
