"""Triton kernels of DeepSeek Sparse Attention (DSA) on the paged caches: the lightning indexer's scores and
the latent decode over only the kept positions.  attention/sparse/dsa.py holds the torch reference both are
tested against (and calls `index_scores` on CUDA); mla/backend.py's TritonMLAAttentionBackend.sparse_decode
calls `sparse_mla_decode`.  Same contracts as the native CPU versions (roofline/cpu/dsa.py).

index_scores(q [c, H, D], w [c, H], cache [1, blocks, bs, 1, D], block_table, first, length, scale) -> [c, length]
    out[r, t] = sum_h w[r, h] * relu(scale * q[r, h] . k_t)   for t <= first + r,   -inf after.
  grid (c, cdiv(length, BLOCK_T)).  A program scores one query row against one tile of BLOCK_T keys, read
  through the block table (row = table[t // bs] * bs + t % bs) once and kept for every head: the heads are
  taken BLOCK_H at a time (H padded with masks, w = 0 there) as one tl.dot [BLOCK_H, D] x [D, BLOCK_T] with
  fp32 accumulation, relu'd, scaled and summed with the heads' weights into the tile's [BLOCK_T] scores.
  Keys past the row's position are never loaded (a tile wholly past it only writes -inf).

sparse_mla_decode(q_abs [n, h, L + R], cache [1, blocks, bs, 1, L + R], block_tables, positions [n, K], ...)
    -> [n, h, L]: each decode row's heads attend (absorbed MLA, one shared latent head) to only its kept
  latent rows; positions holds the valid ones first, -1 after.  It is mla/triton_decode.py's split-KV kernel
  walking the kept list (its GATHER mode: each position mapped through the block table to its latent row, so
  only kept rows are read; rows not kept may hold anything, NaN included), the counts of valid positions in
  place of the sequence lengths.

Any H, h, D, L, R (padded to powers of two >= 16 with masks).  q / q_abs are cast to the cache's dtype for
the tensor-core dot (bf16 on GPUs); fp32 caches dot in "ieee" precision.  A row with no valid position
gives NaN, like the reference's softmax over nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from roofline.attention.mla.triton_decode import mla_decode
from roofline.attention.triton.kernels import interpreting


def _pad(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _dot_options(cache_dtype: torch.dtype) -> dict:
    return dict(UPCAST_DOT=interpreting() and cache_dtype == torch.bfloat16,  # the interpreter's bf16 tl.dot
                DOT_PRECISION="ieee" if cache_dtype == torch.float32 else "tf32")


# ---- the indexer's scores ------------------------------------------------------------------------------

@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, cache_ptr, bt_ptr, out_ptr,
    num_heads, first, length, scale,
    stride_qc, stride_qh, stride_wc, stride_block, stride_slot, stride_oc,
    D: tl.constexpr, D_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    p = first + row  # the row's position: it sees keys 0..p
    offs_t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    seen = (offs_t <= p) & (offs_t < length)
    offs_d = tl.arange(0, D_P)
    d_mask = offs_d < D

    blk = tl.load(bt_ptr + offs_t // BLOCK_SIZE, mask=seen, other=0).to(tl.int64)
    rows = blk * stride_block + (offs_t % BLOCK_SIZE) * stride_slot
    k = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=seen[:, None] & d_mask[None, :], other=0.0)
    if UPCAST_DOT:
        k = k.to(tl.float32)

    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    heads = tl.where(tile * BLOCK_T <= p, num_heads, 0)  # a tile wholly past the row: no work
    for h0 in range(0, heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < num_heads
        q = tl.load(q_ptr + row * stride_qc + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        if UPCAST_DOT:
            q = q.to(tl.float32)
        w = tl.load(w_ptr + row * stride_wc + offs_h, mask=h_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_T], fp32
        s = tl.maximum(s * scale, 0.0)
        acc += tl.sum(w[:, None] * s, 0)

    out = tl.where(offs_t <= p, acc, float("-inf"))
    tl.store(out_ptr + row * stride_oc + offs_t, out, mask=offs_t < length)


def index_scores(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, first: int,
                 length: int, scale: float, block_t: int = 64, block_h: Optional[int] = None) -> torch.Tensor:
    """q [c, H, D], w [c, H] of consecutive tokens at positions first .. first + c - 1; cache the index keys
    [1, blocks, bs, 1, D], block_table the sequence's [blocks] -> [c, length] fp32 scores (-inf past each
    row's position).  See the module doc."""
    c, heads, dim = q.shape
    out = torch.empty((c, length), dtype=torch.float32, device=q.device)
    if c == 0 or length == 0:
        return out
    assert cache.shape[0] == 1 and cache.shape[3] == 1 and cache.shape[4] == dim, (cache.shape, q.shape)
    assert cache.stride(4) == 1 and block_t >= 16 and block_t & (block_t - 1) == 0, (cache.stride(), block_t)
    q = q.to(cache.dtype).contiguous()
    w = w.float().contiguous()
    table = block_table.contiguous()
    if block_h is None:
        block_h = min(64, _pad(heads))
    keys = cache[0]
    _index_scores_kernel[(c, triton.cdiv(length, block_t))](
        q, w, keys, table, out,
        heads, int(first), int(length), float(scale),
        q.stride(0), q.stride(1), w.stride(0), keys.stride(0), keys.stride(1), out.stride(0),
        D=dim, D_P=_pad(dim), BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_SIZE=cache.shape[2],
        **_dot_options(cache.dtype),
    )
    return out


# ---- the latent decode over the kept positions ------------------------------------------------------------

def sparse_mla_decode(q_abs: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                      scale: float, latent_rank: int, num_splits: Optional[int] = None, block_h: int = 16,
                      block_n: int = 32) -> torch.Tensor:
    """q_abs [n, h, L + R] over only each row's kept latent rows (positions [n, K] int64, the valid ones
    first, -1 after; block_tables [>= n, blocks]) -> [n, h, L] in q_abs's dtype.  See the module doc."""
    n = q_abs.shape[0]
    positions = positions.to(torch.int64).contiguous()
    counts = (positions >= 0).sum(dim=1).to(torch.int32)
    return mla_decode(q_abs, cache, block_tables[:n].contiguous(), counts, latent_rank, scale,
                      max_seq_len=positions.shape[1], num_splits=num_splits, block_h=block_h, block_n=block_n,
                      positions=positions)
