"""Triton MLA decode: each decode row's heads attend over its paged latent rows as ONE shared KV head.

Semantics: MLAAttentionBackend.latent_attention (backend.py), the torch reference.
    q_abs [n, H, L + R] (absorbed queries), cache [1, blocks, block_size, 1, L + R] -> out [n, H, L]

Kernel design (split-KV / FlashDecoding):
  grid (n, cdiv(H, BLOCK_H), NUM_SPLITS).  A program holds BLOCK_H query heads of one sequence -- every
  head shares the single latent "KV head", so a latent tile is loaded once for BLOCK_H heads (the MQA
  shape that makes absorbed MLA decode cheap) -- and walks one segment of the sequence's keys in
  BLOCK_N tiles.  A tile's rows are found through the block table (physical block = table[pos //
  block_size], row = pos % block_size).  Scores = q_lat . c^T + q_pe . k_pe^T as two tl.dot (L and R
  padded to powers of two >= 16 with masks), online softmax in base 2 with fp32 running max/sum, and the
  accumulator [BLOCK_H, L] += P . c (values are the latent itself: the first L entries of the rows).
  Each program writes its normalised partial output and base-2 log-sum-exp; the paged-attention
  backend's reduce kernel (triton/kernels.py `_split_kv_reduce_kernel`) combines the segments.
  NUM_SPLITS: with few sequences, n * cdiv(H, BLOCK_H) programs cannot fill the GPU, so each sequence's
  keys are cut into up to 16 segments of >= 256 keys (a power of two); 1 otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from roofline.attention.triton.kernels import LOG2E, _split_kv_reduce_kernel, interpreting

MAX_SPLITS = 16
MIN_SEGMENT = 256
_DEFAULT_NUM_SMS = 132


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, pos_ptr, part_o_ptr, part_lse_ptr,
    num_heads, scale_log2e,
    stride_qn, stride_qh, stride_block, stride_slot, stride_bt, stride_posn, stride_pn, stride_ph, stride_ps,
    L: tl.constexpr, L_P: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, GATHER: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    S = tl.load(seq_lens_ptr + seq)  # positions 0 .. S-1, or (GATHER) the row's first S kept positions
    seg = tl.cdiv(tl.cdiv(S, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * seg
    end = tl.minimum(start + seg, S)

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
        if GATHER:  # DSA: the kept positions, so only their latent rows are read
            pos = tl.load(pos_ptr + seq * stride_posn + idx, mask=valid, other=0)
        else:
            pos = idx
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
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: a tile holds at least one valid key
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


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def choose_num_splits(num_seqs: int, head_blocks: int, max_seq_len: int, device: torch.device) -> int:
    sms = _DEFAULT_NUM_SMS
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(num_seqs * head_blocks, 1)
    if programs >= sms:
        return 1
    return _pow2_floor(min(MAX_SPLITS, -(-2 * sms // programs), max(max_seq_len // MIN_SEGMENT, 1)))


def mla_decode(q_abs: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               latent_rank: int, scale: float, max_seq_len: int, num_splits: Optional[int] = None,
               block_h: int = 16, block_n: int = 32, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n, H, L + R] absorbed decode queries over the latent cache -> [n, H, L] (see the module doc).
    positions (DSA's sparse decode, attention/sparse/triton_dsa.py): [n, K] int64, each row's kept positions
    first; seq_lens then counts them and only those latent rows are read."""
    n, num_heads, width = q_abs.shape
    L, R = latent_rank, width - latent_rank
    out = torch.empty((n, num_heads, L), dtype=q_abs.dtype, device=q_abs.device)
    if n == 0:
        return out
    assert cache.shape[0] == 1 and cache.shape[3] == 1 and cache.shape[4] == width, (cache.shape, q_abs.shape)
    q_abs = q_abs.to(cache.dtype).contiguous()
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(n, head_blocks, max_seq_len, q_abs.device)
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, num_splits
    l_p, r_p = max(16, triton.next_power_of_2(L)), max(16, triton.next_power_of_2(R))
    part_o = torch.empty((n, num_heads, num_splits, l_p), dtype=torch.float32, device=q_abs.device)
    part_lse = torch.empty((n, num_heads, num_splits), dtype=torch.float32, device=q_abs.device)
    sp = (num_heads * num_splits, num_splits, 1)
    lat = cache[0]
    gather = positions is not None
    pos = positions.to(torch.int64).contiguous() if gather else seq_lens  # (unread without GATHER)
    _mla_decode_kernel[(n, head_blocks, num_splits)](
        q_abs, lat, block_tables, seq_lens, pos, part_o, part_lse,
        num_heads, float(scale) * LOG2E,
        q_abs.stride(0), q_abs.stride(1), lat.stride(0), lat.stride(1), block_tables.stride(0),
        pos.stride(0) if gather else 0, *sp,
        L=L, L_P=l_p, R=R, R_P=r_p, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_SIZE=cache.shape[2],
        NUM_SPLITS=num_splits, UPCAST_DOT=interpreting() and cache.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if cache.dtype == torch.float32 else "tf32", GATHER=gather,
    )
    _split_kv_reduce_kernel[(n, num_heads)](
        part_o, part_lse, out, *sp, out.stride(0), out.stride(1), out.stride(2),
        HEAD_DIM=L, HEAD_DIM_P=l_p, NUM_SPLITS=num_splits,
    )
    return out
