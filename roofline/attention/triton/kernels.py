"""Triton kernels for the paged KV cache: K/V write, paged attention (with optional split-KV) and the
split-KV reduction, plus the thin launch wrappers the backend calls.

See roofline/attention/triton/backend.py for the design notes (grid, tiling, block-table reads,
split-KV heuristic).  Everything here is our own code.

Conventions shared by all kernels:
  * kv_cache [2, num_blocks, block_size, H_kv, D]; the K and V halves are passed as two pointers with
    the same strides (block, slot-in-block, head, dim), so any strided view works.
  * Offsets that can exceed 2**31 (token * stride, physical block * stride) are computed in int64.
  * Softmax runs in base 2: scores are multiplied by scale * log2(e) once and exp2 is used throughout,
    so a split's log-sum-exp is stored in base 2 as well.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same, usable inside kernels


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1)."""
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------
# write_kv: one program per new token, copies its [H_kv, D] key and value rows into its slot.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # slot < 0 means "no cache slot for this row" (padding): the whole program becomes a no-op
    # through the mask, so no control flow depends on loaded data.
    blk = tl.maximum(slot, 0) // BLOCK_SIZE
    off = tl.maximum(slot, 0) % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # (broadcast the scalar test through offs_d: the interpreter rejects scalar-bool & tensor-bool)
    slot_ok = (offs_d * 0 + slot) >= 0
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & slot_ok[None, :]

    k = tl.load(key_ptr + tok * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    dst = blk * stride_cb + off * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [N, H_kv, D] -> kv_cache[:, slot]; rows whose slot is negative are skipped."""
    n = key.shape[0]
    if n == 0:
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert key.shape == value.shape == (n, num_kv_heads, head_dim), (key.shape, value.shape, kv_cache.shape)
    assert slot_mapping.shape[0] >= n
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = triton.next_power_of_2(head_dim)
    block_h = triton.next_power_of_2(num_kv_heads)
    _write_kv_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


# ---------------------------------------------------------------------------------------------
# Paged attention.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _attn_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    bt_row_ptr,
    start_n,
    kv_hi,
    q_pos,
    offs_d,
    d_mask,
    scale_log2e,
    stride_cb,
    stride_cs,
    stride_cd,
    window,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False,
):
    """One BLOCK_N-key step of the online softmax for a [BLOCK_M, D] query tile.

    Keys start_n .. start_n+BLOCK_N-1 are logical positions of the request; each one's physical slot
    is found through the block table (one gathered block id per key; with BLOCK_N a multiple of the
    page size that is BLOCK_N // BLOCK_SIZE distinct pages).  MASKED=False is the fast path for
    tiles entirely below the causal diagonal and inside the context: no position masks at all.
    HAS_WINDOW: a row at position p sees keys p - window + 1 .. p only (always MASKED);
    HAS_SOFTCAP: scores s (natural units) become softcap * tanh(s / softcap) before the softmax.
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MASKED:
        n_valid = offs_n < kv_hi
        phys = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    else:
        phys = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    kv_off = phys * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs  # [BLOCK_N] int64

    # K^T tile [D, BLOCK_N].
    k_ptrs = k_base + kv_off[None, :] + offs_d[:, None] * stride_cd
    if MASKED:
        k = tl.load(k_ptrs, mask=d_mask[:, None] & n_valid[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
    if UPCAST_DOT:
        qk = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)
    qk = qk * scale_log2e  # [BLOCK_M, BLOCK_N], base-2 logits
    if HAS_SOFTCAP:  # cap in natural units: s = qk / log2(e); tanh(x) = 1 - 2 / (exp(2x) + 1)
        x = qk / (LOG2E_C * softcap)
        qk = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * LOG2E_C)
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row can have seen no key yet (split segment past its diagonal): keep exp2 away from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)

    # V tile [BLOCK_N, D].
    v_ptrs = v_base + kv_off[:, None] + offs_d[None, :] * stride_cd
    if MASKED:
        v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    p = p.to(v.dtype)
    if UPCAST_DOT:
        pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new


@triton.jit
def _paged_attn_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2e,
    num_reqs,
    stride_qn,
    stride_qh,
    stride_qd,
    stride_on,
    stride_oh,
    stride_od,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_bt,
    stride_pn,
    stride_ph,
    stride_ps,
    window,
    softcap,
    sinks_ptr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
):
    """grid = (num_tokens // BLOCK_Q + num_reqs, H_kv, NUM_SPLITS).

    Axis 0 enumerates query tiles of BLOCK_Q tokens over all requests.  Request r owns the tile ids
    [qsl[r] // BLOCK_Q + r, qsl[r+1] // BLOCK_Q + r + 1), a range at least cdiv(q_len_r, BLOCK_Q)
    long, so a binary search over qsl finds the request; surplus ids exit at once.  The tile holds
    the QUERIES_PER_KV query heads sharing kv head program_id(1): row m is token m // QUERIES_PER_KV,
    head m % QUERIES_PER_KV, so each K/V tile is loaded once for the whole GQA group.
    """
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --- which request owns this tile: last r with qsl[r] // BLOCK_Q + r <= tile_id --------------
    lo = tl.program_id(0) * 0  # int32 scalar 0 (a tensor, so the loop carries a typed value)
    hi = lo + num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first <= tile_id
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    req = lo - 1

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tile = tile_id - (q_start // BLOCK_Q + req)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # cached tokens before this step

    # --- query tile [BLOCK_M, D]: BLOCK_Q tokens x QUERIES_PER_KV heads ---------------------------
    offs_m = tl.arange(0, BLOCK_M)
    tok_in_req = q_tile * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (tok_in_req < q_len)
    q_pos = ctx_len + tok_in_req  # position of each row; it sees keys 0 .. q_pos
    tok = (q_start + tok_in_req).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    q = q.to(k_cache_ptr.dtype.element_ty)

    # --- key range: causal bound of the tile's last row, cut to this split's segment -------------
    first_q_pos = ctx_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_q_pos + BLOCK_Q)  # exclusive; = last row's position + 1
    if NUM_SPLITS == 1:
        kv_lo = kv_end * 0
        if HAS_WINDOW:  # the tile's first row sees keys from first_q_pos - window + 1: earlier tiles are skipped
            kv_lo = (tl.maximum(first_q_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        kv_hi = kv_end
    else:
        seg = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * seg
        kv_hi = tl.minimum(kv_end, kv_lo + seg)
    # Keys < first_q_pos + 1 are visible to every row of the tile: whole BLOCK_N tiles in that range
    # run unmasked, the rest (diagonal and context tail) masked.
    full_hi = tl.minimum(kv_hi, first_q_pos + 1)
    kv_mid = kv_lo + (tl.maximum(full_hi - kv_lo, 0) // BLOCK_N) * BLOCK_N
    if HAS_WINDOW:  # the window's lower edge differs per row: every tile masked
        kv_mid = kv_lo

    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_ch
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_ch
    bt_row_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink is a key without a value: the running max starts at it, the sum at exp2(0) = 1
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * LOG2E_C
        l_i = l_i + 1.0
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    for start_n in range(kv_lo, kv_mid, BLOCK_N):
        acc, l_i, m_i = _attn_kv_tile(
            acc, l_i, m_i, q, k_base, v_base, bt_row_ptr, start_n, kv_hi, q_pos, offs_d, d_mask,
            scale_log2e, stride_cb, stride_cs, stride_cd, window, softcap,
            BLOCK_SIZE, BLOCK_N, False, UPCAST_DOT, DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip
    for start_n in range(kv_mid, kv_hi, BLOCK_N):
        acc, l_i, m_i = _attn_kv_tile(
            acc, l_i, m_i, q, k_base, v_base, bt_row_ptr, start_n, kv_hi, q_pos, offs_d, d_mask,
            scale_log2e, stride_cb, stride_cs, stride_cd, window, softcap,
            BLOCK_SIZE, BLOCK_N, True, UPCAST_DOT, DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    store_mask = row_valid[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + tok[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partial result of this segment: normalised output and its base-2 log-sum-exp
        # (-inf for rows that saw no key in the segment, so the reduction weighs them 0).
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        p_row = tok * stride_pn + head * stride_ph + split * stride_ps
        tl.store(part_o_ptr + p_row[:, None] * HEAD_DIM_P + offs_d[None, :], o, mask=store_mask)
        tl.store(part_lse_ptr + p_row, lse, mask=row_valid)


@triton.jit
def _split_kv_reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pn,
    stride_ph,
    stride_ps,
    stride_on,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """grid = (num_tokens, H_q): out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_mask = offs_d < HEAD_DIM
    base = tok * stride_pn + head * stride_ph + offs_s * stride_ps  # [S]
    lse = tl.load(part_lse_ptr + base)
    m = tl.max(lse, 0)  # finite: split 0 always holds key 0, which every row sees
    w = tl.exp2(lse - m)  # 0 for empty segments
    o = tl.load(part_o_ptr + base[:, None] * HEAD_DIM_P + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + tok * stride_on + head * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    *,
    num_splits: int = 1,
    block_m: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query [N, H_q, D] over the paged cache (see backend.py for the semantics).

    sliding_window / logit_softcap / sinks: backend.py's AttentionOptions (sinks [H_q] fp32; with sinks
    the split-KV path is not taken).
    num_splits > 1 runs the split-KV path (partials + reduce); it must be a power of two.
    block_m / block_n override the tile shapes (block_m rows = tokens x GQA group; both powers of
    two >= 16).
    """
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    assert query.shape[2] == head_dim and num_heads % num_kv_heads == 0, (query.shape, kv_cache.shape)
    group = num_heads // num_kv_heads
    head_dim_p = max(16, triton.next_power_of_2(head_dim))

    if block_m is None:
        if max_query_len <= 1:
            block_m = max(16, triton.next_power_of_2(group))  # decode: one token x the GQA group
        else:
            rows = max_query_len * group
            block_m = 128 if (rows >= 128 and head_dim_p <= 128) else 64
            block_m = max(block_m, triton.next_power_of_2(group))
    assert block_m >= 16 and block_m & (block_m - 1) == 0 and block_m >= group, block_m
    block_q = block_m // group
    if block_n is None:
        block_n = 64 if head_dim_p <= 128 else 32
    assert block_n >= 16 and block_n & (block_n - 1) == 0, block_n
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, num_splits

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    cache_dtype = kv_cache.dtype
    upcast = interpreting() and cache_dtype == torch.bfloat16  # the interpreter's tl.dot mishandles bf16
    precision = "ieee" if cache_dtype == torch.float32 else "tf32"
    scale_log2e = float(scale) * LOG2E
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"attention sinks of shape {tuple(sinks.shape)} for {num_heads} query heads")
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
        num_splits = 1  # the sink enters one softmax once: the plain path

    if num_splits > 1:
        part_o = torch.empty((num_tokens, num_heads, num_splits, head_dim_p), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        sp = (num_heads * num_splits, num_splits, 1)  # strides of part_lse; part_o row = same * head_dim_p
    else:
        part_o = part_lse = out  # unused
        sp = (0, 0, 0)

    grid = (num_tokens // block_q + num_reqs, num_kv_heads, num_splits)
    _paged_attn_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        part_o,
        part_lse,
        block_tables,
        seq_lens,
        query_start_loc,
        scale_log2e,
        num_reqs,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        block_tables.stride(0),
        sp[0],
        sp[1],
        sp[2],
        int(sliding_window or 0),
        float(logit_softcap or 0.0),
        sinks if sinks is not None else out,  # unused without sinks
        QUERIES_PER_KV=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        UPCAST_DOT=upcast,
        DOT_PRECISION=precision,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=logit_softcap is not None,
        HAS_SINKS=sinks is not None,
        num_warps=8 if block_m >= 128 else 4,
        num_stages=2,
    )
    if num_splits > 1:
        _split_kv_reduce_kernel[(num_tokens, num_heads)](
            part_o,
            part_lse,
            out,
            sp[0],
            sp[1],
            sp[2],
            out.stride(0),
            out.stride(1),
            out.stride(2),
            HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p,
            NUM_SPLITS=num_splits,
            num_warps=4 if head_dim_p * num_splits >= 2048 else 2,
        )
    return out
