"""The grouped LoRA shrink/expand over a step's adapter groups: which implementation runs.

`add_lora_torch` is the reference: per group and slice, t = x_g A_s^T then y_g[:, s] += t B_s^T.
"""

from __future__ import annotations

import torch


def add_lora_torch(x: torch.Tensor, y: torch.Tensor, layer, groups) -> None:
    """y[start:end, slice s] += (x[start:end] a[slot, s, :r]^T) b[slot, slice s rows, :r]^T for each
    (slot, r, start, end) group and each slice the slot's adapter has."""
    for slot, r, start, end in groups:
        xs = x[start:end]
        for s, (off, n) in enumerate(layer.slices):
            if not layer.slice_on[slot][s]:
                continue
            t = xs @ layer.a[slot, s, :r].t()  # shrink [rows, r]
            y[start:end, off:off + n].addmm_(t, layer.b[slot, off:off + n, :r].t())  # expand


def add_lora(x: torch.Tensor, y: torch.Tensor, layer, groups) -> None:
    add_lora_torch(x, y, layer, groups)
