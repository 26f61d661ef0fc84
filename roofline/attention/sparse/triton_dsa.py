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
  latent rows; positions holds the valid ones first, -1 after.
  grid (n, cdiv(h, BLOCK_H), NUM_SPLITS), triton_decode.py's split-KV shape over the kept list instead of
  the context: a program holds BLOCK_H heads of one row and walks one segment of its valid positions in
  BLOCK_N tiles, each position mapped through the block table to its latent row, so only kept rows are read
  (rows not kept may hold anything, NaN included).  Scores q_lat . c + q_pe . k_pe as two tl.dot, online
  softmax in base 2 (fp32 running max / sum), acc [BLOCK_H, L] += P . c; each split writes its normalised
  partial and log-sum-exp and triton/kernels.py's `_split_kv_reduce_kernel` combines them (output in
  q_abs's dtype).  NUM_SPLITS: triton_decode.choose_num_splits over the longest kept list.

Any H, h, D, L, R (padded to powers of two >= 16 with masks).  q / q_abs are cast to the cache's dtype for
the tensor-core dot (bf16 on GPUs); fp32 caches dot in "ieee" precision.  A row with no valid position
gives NaN, like the reference's softmax over nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from roofline.attention.mla.triton_decode import choose_num_splits
from roofline.attention.triton.kernels import LOG2E, _split_kv_reduce_kernel, interpreting


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

@triton.jit
def _sparse_mla_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, pos_ptr, counts_ptr, part_o_ptr, part_lse_ptr,
    num_heads, scale_log2e,
    stride_qn, stride_qh, stride_block, stride_slot, stride_bt, stride_posn, stride_pn, stride_ph, stride_ps,
    L: tl.constexpr, L_P: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    count = tl.load(counts_ptr + seq)  # the row's valid positions: the first `count` entries
    seg = tl.cdiv(tl.cdiv(count, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * seg
    end = tl.minimum(start + seg, count)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_l = tl.arange(0, L_P)
    l_mask = offs_l < L
    offs_r = tl.arange(0, R_P)
    r_mask = offs_r < R
    q_base = q_ptr + seq * stride_qn + offs_h[:, None] * stride_qh
    q_lat = tl.load(q_base + offs_l[None, :], mask=h_mask[:, None] & l_mask[None, :], other=0.0)
    q_pe = tl.load(q_base + L + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, L_P], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        idx = n0 + tl.arange(0, BLOCK_N)
        valid = idx < end
        pos = tl.load(pos_ptr + seq * stride_posn + idx, mask=valid, other=0)
        valid = valid & (pos >= 0)
        pos = tl.where(valid, pos, 0)
        blk = tl.load(bt_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = blk * stride_block + (pos % BLOCK_SIZE) * stride_slot
        c = tl.load(cache_ptr + rows[:, None] + offs_l[None, :], mask=valid[:, None] & l_mask[None, :], other=0.0)
        k_pe = tl.load(cache_ptr + rows[:, None] + L + offs_r[None, :], mask=valid[:, None] & r_mask[None, :],
                       other=0.0)
        if UPCAST_DOT:
            c = c.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * scale_log2e, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: a tile holds at least one valid position
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m = m_new

    has = s_sum > 0
    o = acc / tl.where(has, s_sum, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, s_sum, 1.0)), float("-inf"))
    base = seq * stride_pn + offs_h * stride_ph + split * stride_ps
    tl.store(part_lse_ptr + base, lse, mask=h_mask)
    tl.store(part_o_ptr + base[:, None] * L_P + offs_l[None, :], o, mask=h_mask[:, None])


def sparse_mla_decode(q_abs: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                      scale: float, latent_rank: int, num_splits: Optional[int] = None, block_h: int = 16,
                      block_n: int = 32) -> torch.Tensor:
    """q_abs [n, h, L + R] over only each row's kept latent rows (positions [n, K] int64, the valid ones
    first, -1 after; block_tables [>= n, blocks]) -> [n, h, L] in q_abs's dtype.  See the module doc."""
    n, num_heads, width = q_abs.shape
    L, R = latent_rank, width - latent_rank
    out = torch.empty((n, num_heads, L), dtype=q_abs.dtype, device=q_abs.device)
    if n == 0:
        return out
    assert cache.shape[0] == 1 and cache.shape[3] == 1 and cache.shape[4] == width, (cache.shape, q_abs.shape)
    assert cache.stride(4) == 1 and positions.shape[0] == n, (cache.stride(), positions.shape)
    q = q_abs.to(cache.dtype).contiguous()
    positions = positions.to(torch.int64).contiguous()
    counts = (positions >= 0).sum(dim=1).to(torch.int32)
    tables = block_tables[:n].contiguous()
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(n, head_blocks, positions.shape[1], q.device)
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, num_splits
    l_p, r_p = _pad(L), _pad(R)
    part_o = torch.empty((n, num_heads, num_splits, l_p), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=q.device)
    sp = (num_heads * num_splits, num_splits, 1)
    lat = cache[0]
    _sparse_mla_decode_kernel[(n, head_blocks, num_splits)](
        q, lat, tables, positions, counts, part_o, part_lse,
        num_heads, float(scale) * LOG2E,
        q.stride(0), q.stride(1), lat.stride(0), lat.stride(1), tables.stride(0), positions.stride(0), *sp,
        L=L, L_P=l_p, R=R, R_P=r_p, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_SIZE=cache.shape[2],
        NUM_SPLITS=num_splits, **_dot_options(cache.dtype),
    )
    _split_kv_reduce_kernel[(n, num_heads)](
        part_o, part_lse, out, *sp, out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=L, HEAD_DIM_P=l_p, NUM_SPLITS=num_splits,
    )
    return out
