"""The LoRA delta of one linear layer over a step's rows, grouped by adapter.

`LoRALayer` hangs off a LinearBase as `layer.lora` (the one seam: LinearBase.forward and
RowParallelLinear.forward call `lora.apply(x, y)` after their own product, before any all-reduce).  It
holds the layer's adapter weights in fixed slots, one per adapter that may run in a step (max_loras):

    a  [max_loras, S, max_rank, in]   each slice's lora_A (S: the layer's output slices, mapping.py)
    bt [max_loras, max_rank, out]     lora_B of each slice, transposed, in the slice's output columns, scaling
                                      folded in (an expand row is a contiguous run of outputs)

and a slot holding an adapter of rank r uses its first r rank columns.  The step's rows are described by
`StepBatch` (the model runner builds it once per step): segments of consecutive rows under one slot.
For each adapter group the delta is a shrink then an expand:

    t = x_g A_s^T   [rows, r]        y_g[:, slice s] += t B_s^T

(`ops.py` runs it: the native CPU kernel, Triton on CUDA, torch otherwise).  Rows of the base model
(slot -1) are not touched.  A layer whose adapter has no weights for it, or for one of its slices, skips
them.
"""

from __future__ import annotations

from typing import Optional

import torch

from roofline.lora.mapping import Target

BASE = -1  # the slot of rows that run the base model


def _segments(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(slot, rows) runs -> (slot, start, end) segments of adapter rows, neighbours of one slot merged."""
    segs: list[list[int]] = []
    start = 0
    for slot, n in runs:
        if n <= 0:
            continue
        if slot != BASE:
            if segs and segs[-1][0] == slot and segs[-1][2] == start:
                segs[-1][2] = start + n
            else:
                segs.append([slot, start, start + n])
        start += n
    return [tuple(s) for s in segs]


class StepBatch:
    """Which slot each row of a step runs under, as segments of consecutive rows.  Two views: all rows, and
    the rows kept after the last layer's attention (the model's output_rows), told apart by row count."""

    def __init__(self, runs: list[tuple[int, int]], kept_rows: Optional[list[int]] = None) -> None:
        self.num_rows = sum(n for _, n in runs)
        self.segments = _segments(runs)
        self.kept: Optional[list[tuple[int, int, int]]] = None
        if kept_rows is not None and len(kept_rows) != self.num_rows:
            bounds, slots, at = [], [], 0
            for slot, n in runs:
                at += n
                bounds.append(at)
                slots.append(slot)
            kept_runs, j = [], 0
            for row in kept_rows:
                while bounds[j] <= row:
                    j += 1
                kept_runs.append((slots[j], 1))
            self.kept = _segments(kept_runs)
            self.num_kept = len(kept_rows)

    @property
    def has_adapter_rows(self) -> bool:
        return bool(self.segments)

    def segments_for(self, rows: int) -> list[tuple[int, int, int]]:
        if rows == self.num_rows:
            return self.segments
        if self.kept is not None and rows == self.num_kept:
            return self.kept
        raise RuntimeError(f"a LoRA layer got {rows} rows in a step of {self.num_rows} rows"
                           + (f" ({self.num_kept} kept)" if self.kept is not None else "")
                           + ": the adapter rows cannot be placed")


class LoRAStepState:
    """What every LoRA layer of a model shares: each slot's rank and the step's batch (None between steps
    and in steps without adapter rows)."""

    def __init__(self, max_loras: int) -> None:
        self.ranks = [0] * max_loras
        self._batch: Optional[StepBatch] = None
        self.step_cache: dict = {}  # what kernels derive from the step's groups (emptied with every batch)

    @property
    def batch(self) -> Optional[StepBatch]:
        return self._batch

    @batch.setter
    def batch(self, batch: Optional[StepBatch]) -> None:
        self._batch = batch
        self.step_cache = {}

    @property
    def active(self) -> bool:
        return self.batch is not None and self.batch.has_adapter_rows


class LoRALayer:
    def __init__(self, target: Target, state: LoRAStepState, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device) -> None:
        self.target = target
        self.state = state
        nslices = len(target.slices)
        self.slices = [(s.offset, s.size) for s in target.slices]
        self.a = torch.zeros((max_loras, nslices, max_rank, target.in_local), dtype=dtype, device=device)
        self.bt = torch.zeros((max_loras, max_rank, target.out_local), dtype=dtype, device=device)
        self.slice_on = [[False] * nslices for _ in range(max_loras)]  # which slices the slot's adapter has
        # the same, and the slices' columns, as the native kernel reads them (CPU tensors)
        self.slice_on_t = torch.zeros((max_loras, nslices), dtype=torch.uint8)
        self.slice_off_t = torch.tensor([off for off, _ in self.slices], dtype=torch.int64)
        self.slice_size_t = torch.tensor([n for _, n in self.slices], dtype=torch.int64)
        self._device_tables = None  # (slice_on, offsets, sizes) on the weights' device (Triton), when asked

    def load_slot(self, slot: int, weights: Optional[tuple[torch.Tensor, torch.Tensor, list[bool]]]) -> None:
        """weights: (a [S, r, in], b [out, r], slices present) of this rank, or None (no weights here)."""
        on = [False] * len(self.slices) if weights is None else list(weights[2])
        if weights is not None:
            a, b, _ = weights
            r = a.shape[1]
            self.a[slot, :, :r].copy_(a)
            self.bt[slot, :r].copy_(b.t())
        self.slice_on[slot] = on
        self.slice_on_t[slot] = torch.tensor(on, dtype=torch.uint8)
        self._device_tables = None

    def device_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """slice_on, the slices' offsets and sizes, on the weights' device."""
        if self._device_tables is None:
            dev = self.a.device
            self._device_tables = (self.slice_on_t.to(dev), self.slice_off_t.to(dev), self.slice_size_t.to(dev))
        return self._device_tables

    def groups(self, rows: int) -> list[tuple[int, int, int, int]]:
        """This step's (slot, rank, start, end) segments with weights here."""
        return [(slot, self.state.ranks[slot], s, e) for slot, s, e in self.state.batch.segments_for(rows)
                if any(self.slice_on[slot])]

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [rows, out] (the base product) plus each adapter row's delta; y itself when no row has one."""
        if not self.state.active:
            return y
        groups = self.groups(x.shape[0])
        if not groups:
            return y
        from roofline.lora import ops

        ops.add_lora(x, y, self, groups)
        return y
