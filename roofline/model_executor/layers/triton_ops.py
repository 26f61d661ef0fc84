"""Fused Triton kernels for the per-token layers of the Llama family (CUDA fast path).

    rms_norm(x, weight, eps, residual=None)   RMSNorm, optionally fused with the residual add
    silu_and_mul(x)                            SwiGLU gate on the merged [gate | up] tensor
    rotary_embedding_(q, k, cos, sin)          rotate-half RoPE, in place, partial rotary allowed

Each one is a single kernel launch that reads its inputs once and writes its outputs once (the torch
layers take 3-8 launches and as many round trips through memory).  They reproduce the torch layers of
roofline (norm.py, activation.py, rotary.py) operation by operation, including the places where the
torch code rounds an intermediate to the activation dtype (the residual sum, the normalised value
before the weight, silu before the product, each rope product), so on a GPU the results differ from
the torch path only by the reduction order of the norm's sum of squares and the approximations of
rsqrt/exp -- a few fp32 ulps, at most an ulp of bf16/fp16 after rounding.  Under the Triton
interpreter (CPU tests) casts to bf16/fp16 round toward zero, hence the looser tolerances of the
half-precision tests.

Nothing here is called on CPU tensors by the model: the layers dispatch through
roofline.model_executor.layers.fused_ops, which only picks these kernels for CUDA tensors.
Everything here is our own code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# RMSNorm (+ residual add)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    rows_per_group,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One program per row.  A row is (g, i) = divmod(row, rows_per_group), so [N, H, D] views with
    any strides on the first two dims (q/k of a split qkv, for the per-head norm) need no copy.

    With a residual: s = x + residual, rounded to the sum's dtype (res_out's element type), stored as
    the new residual, and normalised.  norm: y = (s32 * rsqrt(mean(s32^2) + eps)) cast to s's dtype,
    out = y * w (product in fp32, cast to out's dtype) -- the exact op order of norm.py.
    """
    row = tl.program_id(0).to(tl.int64)
    g = row // rows_per_group
    i = row % rows_per_group
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + g * stride_x0 + i * stride_x1 + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + g * stride_r0 + i * stride_r1 + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * HIDDEN + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / HIDDEN
    rstd = tl.rsqrt(var + eps)  # torch.rsqrt, as norm.py
    y = (x * rstd).to(res_out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, rows_per_group, stride0, stride1) addressing the rows of t without a copy when t is
    2-D or 3-D with a unit-stride last dim; anything else is made contiguous first."""
    if t.dim() > 3:
        t = t.reshape(-1, t.shape[-1])
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t, 1, 0, 0
    if t.dim() == 2:
        return t, 1, t.stride(0), 0
    return t, t.shape[1], t.stride(0), t.stride(1)


def _norm_warps(block: int) -> int:
    return 16 if block >= 16384 else 8 if block >= 4096 else 4 if block >= 1024 else 2 if block >= 256 else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, same contract as RMSNorm.forward in norm.py:
    without residual: norm(x);  with residual: (norm(x + residual), x + residual).
    Inputs may be strided views (unit stride on the last dim avoids a copy); outputs are new
    contiguous tensors, inputs are never written."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, x.shape)
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=sum_dtype, device=x.device) if residual is not None else None
    n_rows = x.numel() // hidden if hidden else 0
    if n_rows == 0:
        return out if residual is None else (out, res_out)
    xv, per_group, sx0, sx1 = _rows_view(x)
    if residual is not None:
        assert residual.shape == x.shape, (residual.shape, x.shape)
        rv, r_per_group, sr0, sr1 = _rows_view(residual)
        if r_per_group != per_group:  # different leading layout: give it x's
            rv = residual.reshape(x.shape).contiguous()
            rv, _, sr0, sr1 = _rows_view(rv)
    else:
        rv, sr0, sr1 = xv, 0, 0
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(n_rows,)](
        xv,
        rv,
        weight,
        out,
        res_out if res_out is not None else xv,  # element type = the dtype normalised values are cast to
        per_group,
        sx0,
        sx1,
        sr0,
        sr1,
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=_norm_warps(block),
    )
    return out if residual is None else (out, res_out)


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul
# ---------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    """grid (rows, cdiv(d, BLOCK)): out[r, j] = silu(x[r, j]) * x[r, d + j].

    As in activation.py: silu(g) = g / (1 + exp(-g)) in fp32, rounded to the activation dtype, then
    the product in fp32 rounded again."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    base = x_ptr + row * stride_x
    gate = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + d + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:]  of shape [..., d]."""
    two_d = x.shape[-1]
    assert two_d % 2 == 0, x.shape
    d = two_d // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, two_d)  # a view for the usual 2-D / contiguous inputs
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](
        x2, out, d, x2.stride(0), d, BLOCK=block, num_warps=4 if block >= 512 else 2 if block >= 128 else 1
    )
    return out


# ---------------------------------------------------------------------------------------------
# Rotary embedding (rotate-half), in place
# ---------------------------------------------------------------------------------------------


@triton.jit
def _rope_heads(
    base_ptr, stride_h, num_heads, c1, c2, s1, s2, offs_r, r_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    """Rotate the first 2*HALF dims of `num_heads` heads of one token, in place.
    rotate_half(x) = [-x2, x1], so  out1 = x1 c1 - x2 s1,  out2 = x2 c2 + x1 s2;  each product and the
    sum are rounded to the tensor's dtype, as the torch expression q * cos + rotate_half(q) * sin is."""
    dt = base_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h[:, None] < num_heads) & r_mask[None, :]
    p1 = base_ptr + offs_h[:, None].to(tl.int64) * stride_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + ((-x2) * s1[None, :]).to(dt).to(tl.float32)
    o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_cn,
    stride_sn,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """grid (N, 2): program (t, 0) rotates token t's query heads, (t, 1) its key heads."""
    tok = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    c1 = tl.load(cos_ptr + tok * stride_cn + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * stride_cn + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * stride_sn + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * stride_sn + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr + tok * stride_qn, stride_qh, num_q_heads, c1, c2, s1, s2, offs_r, r_mask, HALF, BLOCK_H)
    else:
        _rope_heads(k_ptr + tok * stride_kn, stride_kh, num_k_heads, c1, c2, s1, s2, offs_r, r_mask, HALF, BLOCK_H)


def rotary_embedding_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [N, H, D] and k [N, H_kv, D] in place with cos/sin [N, 1, rot] (or [N, rot]) as built by
    RotaryEmbedding.cos_sin; dims rot..D are left as they are (partial rotary).  q and k may be strided
    views (e.g. slices of the fused qkv output) as long as their last dim has unit stride.
    cos/sin must have q's dtype (they do: cos_sin casts to it).  Returns (q, k)."""
    n, num_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == n and k.shape[2] == head_dim, (q.shape, k.shape)
    assert q.dtype == k.dtype == cos.dtype == sin.dtype, (q.dtype, k.dtype, cos.dtype, sin.dtype)
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rotary_embedding_ needs a unit-stride head dim"
    rot = cos.shape[-1]
    assert rot % 2 == 0 and rot <= head_dim and sin.shape[-1] == rot, (cos.shape, sin.shape, head_dim)
    if n == 0:
        return q, k
    cos2, sin2 = cos.reshape(n, rot), sin.reshape(n, rot)
    if cos2.stride(-1) != 1:
        cos2 = cos2.contiguous()
    if sin2.stride(-1) != 1:
        sin2 = sin2.contiguous()
    half = rot // 2
    block_r = triton.next_power_of_2(half)
    block_h = triton.next_power_of_2(max(num_heads, k.shape[1]))
    _rope_kernel[(n, 2)](
        q,
        k,
        cos2,
        sin2,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos2.stride(0),
        sin2.stride(0),
        num_heads,
        k.shape[1],
        HALF=half,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        num_warps=4 if block_h * block_r >= 2048 else 2 if block_h * block_r >= 512 else 1,
    )
    return q, k
