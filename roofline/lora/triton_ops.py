"""Triton kernels of LoRA's grouped shrink and expand (CUDA; the CPU tests run them through Triton's
interpreter, TRITON_INTERPRET=1).

The step's adapter groups (slot, rank r, rows [start, end)) are cut into tiles of BLOCK_M rows; a tile
table (its group's slot and rank, its first and last row) drives both kernels:

    shrink  grid (tiles, slices):            t[rows, s, :r] = x[rows] a[slot, s, :r]^T       (fp32)
    expand  grid (tiles, slices, col blocks): y[rows, off_s + cols] += t[rows, s, :r] bt[slot, :r, off_s + cols]

Ranks at or past r are masked (a slot's columns past its adapter's rank may hold an earlier adapter's
weights), slices the slot's adapter has no weights for are skipped, rows outside the groups are not read
or written.  Both products run on fp32 tiles with fp32 sums (the shrink's result t stays fp32), and the
expand rounds once into y's dtype: IEEE fp32 for fp32 models, TF32 for bf16 / fp16 ones (their values, and
their products, are exact in TF32; t is rounded to TF32's 10-bit mantissa, as the half-precision models'
own intermediate would be).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per tile (tl.dot needs 16 or more)
BLOCK_K = 64  # input features per shrink step
BLOCK_N = 64  # output columns per expand program


@triton.jit
def _tile(tiles_ptr, tile):
    """A tile's (slot, rank, first row, end row) from the tile table."""
    return (tl.load(tiles_ptr + tile * 4), tl.load(tiles_ptr + tile * 4 + 1), tl.load(tiles_ptr + tile * 4 + 2),
            tl.load(tiles_ptr + tile * 4 + 3))


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, t_ptr, tiles_ptr, on_ptr, in_features, stride_x, n_slices, max_rank,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    slot, rank, row0, row1 = _tile(tiles_ptr, tile)
    if tl.load(on_ptr + slot * n_slices + s) != 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        row_ok = rows < row1
        rank_ok = ranks < rank
        a_base = a_ptr + (slot * n_slices + s) * max_rank * in_features
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            xb = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            ab = tl.load(a_base + ranks[None, :] * in_features + ks[:, None], mask=rank_ok[None, :] & k_ok[:, None],
                         other=0.0)  # [BLOCK_K, BLOCK_R]: a's rows transposed
            acc += tl.dot(xb.to(tl.float32), ab.to(tl.float32), input_precision=PRECISION)
        t_ptrs = t_ptr + (rows[:, None] * n_slices + s) * BLOCK_R + ranks[None, :]
        tl.store(t_ptrs, acc, mask=row_ok[:, None])


@triton.jit
def _expand_kernel(t_ptr, bt_ptr, y_ptr, tiles_ptr, on_ptr, off_ptr, size_ptr, out_features, stride_y, n_slices,
                   max_rank, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    nb = tl.program_id(2)
    slot, rank, row0, row1 = _tile(tiles_ptr, tile)
    size = tl.load(size_ptr + s)
    if (tl.load(on_ptr + slot * n_slices + s) != 0) & (nb * BLOCK_N < size):
        off = tl.load(off_ptr + s)
        rows = row0 + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, BLOCK_R)
        cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < row1
        col_ok = cols < size
        rank_ok = ranks < rank
        tb = tl.load(t_ptr + (rows[:, None] * n_slices + s) * BLOCK_R + ranks[None, :],
                     mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        bb = tl.load(bt_ptr + (slot * max_rank + ranks[:, None]) * out_features + off + cols[None, :],
                     mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        delta = tl.dot(tb, bb.to(tl.float32), input_precision=PRECISION)
        y_ptrs = y_ptr + rows[:, None] * stride_y + off + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def tile_table(groups, device) -> torch.Tensor:
    """[tiles, 4] int32 (slot, rank, first row, end row) of BLOCK_M-row tiles over the groups."""
    tiles = [(slot, r, r0, min(r0 + BLOCK_M, end)) for slot, r, start, end in groups
             for r0 in range(start, end, BLOCK_M)]
    return torch.tensor(tiles, dtype=torch.int32).to(device)


def add_lora(x: torch.Tensor, y: torch.Tensor, layer, groups) -> None:
    """y += the groups' deltas (layers.LoRALayer's slots), by the shrink then the expand kernel."""
    if not groups:
        return
    device = x.device
    nslices, max_rank, in_features = layer.a.shape[1], layer.a.shape[2], layer.a.shape[3]
    block_r = max(16, triton.next_power_of_2(max_rank))
    key = ("triton_tiles", tuple(groups))
    tiles = layer.state.step_cache.get(key)
    if tiles is None:  # the step's layers mostly share their groups: one table per step
        tiles = layer.state.step_cache[key] = tile_table(groups, device)
    on, off, size = layer.device_tables()
    t = torch.empty((x.shape[0], nslices, block_r), dtype=torch.float32, device=device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # bf16 / fp16 values are exact in TF32
    if x.stride(1) != 1:
        x = x.contiguous()
    _shrink_kernel[(tiles.shape[0], nslices)](x, layer.a, t, tiles, on, in_features, x.stride(0), nslices, max_rank,
                                              BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, PRECISION=precision)
    widest = int(layer.slice_size_t.max())
    _expand_kernel[(tiles.shape[0], nslices, triton.cdiv(widest, BLOCK_N))](
        t, layer.bt, y, tiles, on, off, size, y.shape[1], y.stride(0), nslices, max_rank, BLOCK_M=BLOCK_M,
        BLOCK_R=block_r, BLOCK_N=BLOCK_N, PRECISION=precision)
