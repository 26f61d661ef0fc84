"""Triton kernels for DeepSeek-style block-FP8 linear layers (weights float8_e4m3fn with one fp32 scale
per [scale_rows, block_k] block), and their torch references.

    per_token_group_quant_fp8(x, group)          x [M, K] -> x_q [M, K] e4m3, x_s [M, ceil(K/group)] fp32
    w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, block_k, scale_rows, out_dtype, bias)    -> y [M, N]
    weight_only_block_fp8_matmul(x, w_q, w_s, block_k, scale_rows, out_dtype, bias)    -> y [M, N]
    block_fp8_linear(x, w_q, w_s, block_k, scale_rows, bias, mode)   x [..., K] -> y [..., N] (x's dtype)
    dequantize_block_fp8(w_q, w_s, block_k, scale_rows)             -> fp32 [N, K] (the reference weight)

Layouts: w_q [N, K] e4m3 (or the same bytes as uint8), w_s [ceil(N/scale_rows), ceil(K/block_k)] fp32:
weight element (n, k) is w_q[n, k] * w_s[n // scale_rows, k // block_k].  DeepSeek-V3 checkpoints have
scale_rows = block_k = 128 (their `weight_scale_inv` is this multiplier, despite the name);
scale_rows = 1 is a scale row per weight row (scales expanded by the loader).  K need not be a
multiple of block_k (kv_a 576 = 4.5 blocks): the last block is partial and masked.

Activation quantisation is DeepSeek's recipe: per row and per `group` (= block_k) columns,
s = max(amax|x|, 1e-10) / 448, x_q = e4m3(clamp(x / s, -448, 448)), both divisions IEEE-rounded and
the cast round-to-nearest-even, so on a GPU the kernel matches the torch reference byte for byte.

The two GEMMs share one tiling: a program owns a [BLOCK_M, BLOCK_N] output tile and walks K in
BLOCK_K = block_k steps (or a divisor of it), so every K step lies in one scale block and its partial
product is scaled once, in fp32, before it joins the fp32 accumulator:
    acc += dot(x tile, w tile^T) * x_s[rows, kb][:, None] * w_s[cols // scale_rows, kb][None, :]
  * w8a8 (GPUs with FP8 tensor cores, compute capability >= 8.9): both operands e4m3, tl.dot in fp8
    with fp32 accumulation.  Hopper's wgmma adds the products of one K tile with a ~14-bit mantissa
    (Triton's default on sm90), so the fp32 promotion every block_k = 128 is also DeepSeek's accuracy
    fix: ~1e-4 of the output's range from the exact product of the dequantised operands (1e-7 with
    BLOCK_M = 16, which runs on mma.sync).
  * weight-only (any GPU, incl. Ampere, where Triton has no e4m3 type): the weight bytes are loaded as
    uint8 and decoded exactly with integer ops into fp16 (the value / 256), cast to x's dtype and dotted
    with x (bf16/fp16 tensor cores, fp32 x as IEEE fp32); the 256 is folded into the block scale.

Under TRITON_INTERPRET=1 (CPU tests; checked with triton 3.9) tl.dot on e4m3 operands works (the
interpreter widens them to fp16, exactly, and multiplies in fp32), and the e4m3 -> fp32 cast is exact;
two things are not, so two constexpr flags, set only under the interpreter, step around them:
  * its fp32 -> e4m3 cast drops a mantissa carry (1.96 -> 1.0) and misrounds subnormals: the
    quantisation kernel first rounds to the e4m3 grid itself (RNE, bit arithmetic; ROUND_IN_FP32),
    after which the cast is exact;
  * its tl.dot multiplies bf16 operands as their raw uint16 bits: the weight-only kernel upcasts bf16
    tiles to fp32 first (UPCAST).
Everything here is our own code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from roofline.attention.triton.kernels import interpreting

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_MIN = 1e-10  # floor of a group's amax (an all-zero group gets a tiny, finite scale)

# ---------------------------------------------------------------------------------------------
# Activation quantisation: per (row, group of columns)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value (ties to even), still fp32, sign kept.
    Normals: round the fp32 mantissa to 3 bits on the bit pattern (a carry rolls into the exponent);
    below 2^-6 the e4m3 grid is uniform 2^-9 steps: the 1.5 * 2^23 trick rounds v * 2^9."""
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = bits & 0x7FFFFFFF
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576  # keep sign, exponent and 3 mantissa bits
    a = tl.abs(v)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    rounded = tl.where(a < 0.015625, sub.to(tl.int32, bitcast=True), normal)
    return (rounded | sign).to(tl.float32, bitcast=True)


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    K, n_groups, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):
    """One program per (row, GROUPS_PER_PROG groups), a group per tile row: x_s = max(amax, 1e-10) / 448,
    x_q = e4m3(clamp(x / x_s, -448, 448))."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    cols = tl.arange(0, BLOCK)
    offs = groups[:, None] * GROUP + cols[None, :]  # [GROUPS_PER_PROG, BLOCK]
    ok = (offs < K) & (cols < GROUP)[None, :]
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    s = tl.div_rn(amax, tl.zeros_like(amax) + 448.0)
    y = tl.div_rn(x, tl.zeros_like(x) + s[:, None])  # IEEE division, as torch's tensor / tensor
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if ROUND_IN_FP32:  # the interpreter's fp32 -> e4m3 cast is wrong: hand it exact e4m3 values only
        y = _round_to_e4m3(y)
    tl.store(q_ptr + row * stride_qm + offs, y.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + groups, s, mask=groups < n_groups)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32/bf16/fp16 -> (x_q [M, K] float8_e4m3fn, x_s [M, ceil(K/group)] fp32)."""
    assert x.dim() == 2, "x must be [M, K]"
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(k, group)
    x_q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    x_s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return x_q, x_s
    block = triton.next_power_of_2(group)
    per_prog = max(1, min(triton.next_power_of_2(groups), 1024 // block))  # ~1024 elements a program
    _group_quant_kernel[(m, triton.cdiv(groups, per_prog))](
        x, x_q, x_s, k, groups, x.stride(0), x_q.stride(0), x_s.stride(0),
        GROUP=group, BLOCK=block, GROUPS_PER_PROG=per_prog, ROUND_IN_FP32=interpreting(),
        num_warps=max(1, min(4, per_prog * block // 256)),
    )
    return x_q, x_s


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recipe in torch (the test reference)."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    xf = x.float()
    padded = torch.nn.functional.pad(xf, (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1).clamp(min=SCALE_MIN)
    # Tensor divisors throughout: torch divides by a Python scalar as a multiply by its reciprocal on CUDA.
    x_s = amax / torch.full_like(amax, FP8_MAX)
    s_full = x_s.repeat_interleave(group, dim=1)[:, :k]
    x_q = (xf / s_full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x_q, x_s


# ---------------------------------------------------------------------------------------------
# The block-scaled GEMMs
# ---------------------------------------------------------------------------------------------


@triton.jit
def _w8a8_block_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr,
    M, N, K, scale_rows,
    stride_am, stride_asm, stride_wn, stride_wsn, stride_cm,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr,
):
    """c[m, n] = sum_k a[m, k] * w[n, k] * as[m, k // SCALE_K] * ws[n // scale_rows, k // SCALE_K]
    (+ bias[n]); a, w e4m3, one fp8 tl.dot per K step, fp32 accumulation."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # rows past M repeat real rows, never stored
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    ws_ptrs = ws_ptr + (offs_n // scale_rows).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        kb = k0 // SCALE_K
        a_s = tl.load(as_ptrs + kb)
        w_s = tl.load(ws_ptrs + kb)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _weight_only_block_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, c_ptr,
    M, N, K, scale_rows,
    stride_xm, stride_wn, stride_wsn, stride_cm,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr,
):
    """c = x @ dequant(w)^T (+ bias) with w the e4m3 bytes as uint8: each byte is decoded exactly to the
    fp16 with bits (sign << 15) | (exp+mantissa << 7), which is the e4m3 value / 256 (normals and
    subnormals alike), cast to x's dtype, dotted with x, and the partial product is scaled by
    256 * its block scale."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    ws_ptrs = ws_ptr + (offs_n // scale_rows).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = offs_k + k0 < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0)
        h = ((b & 0x80).to(tl.uint16) << 8) | ((b & 0x7F).to(tl.uint16) << 7)
        w = h.to(tl.float16, bitcast=True).to(x.dtype)
        w_s = tl.load(ws_ptrs + k0 // SCALE_K) * 256.0
        if UPCAST:  # interpreter only: its tl.dot multiplies bf16 operands as their raw uint16 bits
            part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE:
            part = tl.dot(x, w, input_precision="ieee")
        else:
            part = tl.dot(x, w)
        acc += part * w_s[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def _tiles(m: int, block_k: int) -> dict:
    """The launch config, fixed by M (no autotuning: deterministic, and cheap under the interpreter).
    Small M (decode) takes narrow N tiles so more programs stream the weight.  Measured on an H200
    (scripts/gpu_fp8_bench.py --sweep), w8a8: for M > 64, 64x128 tiles with 4 warps and 4 stages beat
    128x128 with 8 warps (750 vs 610 TFLOP/s at M=2048, N=36864, K=7168); BLOCK_N 64 is best to M=64."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, 128), num_warps=4, num_stages=4)


def _check_weight(w_q: torch.Tensor, w_s: torch.Tensor, k: int, block_k: int, scale_rows: int):
    n = w_q.shape[0]
    assert w_q.dim() == 2 and w_q.shape[1] == k, f"w_q {tuple(w_q.shape)} does not match K={k}"
    assert w_q.dtype in (torch.float8_e4m3fn, torch.uint8), f"w_q must be float8_e4m3fn or uint8, not {w_q.dtype}"
    assert block_k >= 16 and block_k & (block_k - 1) == 0, "block_k must be a power of two >= 16"
    assert w_s.shape == (triton.cdiv(n, scale_rows), triton.cdiv(k, block_k)), (
        f"w_s {tuple(w_s.shape)} != [ceil({n}/{scale_rows}), ceil({k}/{block_k})]")
    if w_q.stride(-1) != 1:
        w_q = w_q.contiguous()
    return w_q, w_s.float().contiguous()


def w8a8_block_fp8_matmul(x_q: torch.Tensor, x_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                          block_k: int, scale_rows: int, out_dtype: torch.dtype = torch.bfloat16,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x_q [M, K] e4m3, x_s [M, ceil(K/block_k)] fp32, w_q [N, K] e4m3|uint8, w_s [ceil(N/scale_rows),
    ceil(K/block_k)] fp32 -> y [M, N] out_dtype (+ bias [N]).  Needs FP8 tensor cores (sm >= 8.9)."""
    m, k = x_q.shape
    w_q, w_s = _check_weight(w_q, w_s, k, block_k, scale_rows)
    n = w_q.shape[0]
    assert x_q.dtype == torch.float8_e4m3fn and x_s.shape == (m, triton.cdiv(k, block_k))
    w_q = w_q.view(torch.float8_e4m3fn)
    x_q = x_q if x_q.stride(-1) == 1 else x_q.contiguous()
    x_s = x_s.float().contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return y
    cfg = _tiles(m, block_k)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _w8a8_block_kernel[grid](
        x_q, x_s, w_q, w_s, bias if bias is not None else y, y,
        m, n, k, scale_rows,
        x_q.stride(0), x_s.stride(0), w_q.stride(0), w_s.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, SCALE_K=block_k, **cfg,
    )
    return y


def weight_only_block_fp8_matmul(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, block_k: int,
                                 scale_rows: int, out_dtype: torch.dtype | None = None,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16/fp32, w_q/w_s as w8a8_block_fp8_matmul -> y [M, N] (out_dtype, default x's):
    F.linear(x, dequantize_block_fp8(w_q, w_s, ...)) up to the order of the fp32 sums."""
    m, k = x.shape
    w_q, w_s = _check_weight(w_q, w_s, k, block_k, scale_rows)
    n = w_q.shape[0]
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x dtype {x.dtype}"
    w_q = w_q.view(torch.uint8)
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = _tiles(m, block_k)
    if cfg["BLOCK_N"] >= 128:  # a stage holds 16 KiB of x and 16 KiB of weight, + the decoded tile: fit A100
        cfg["num_stages"] = 3
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _weight_only_block_kernel[grid](
        x, w_q, w_s, bias if bias is not None else y, y,
        m, n, k, scale_rows,
        x.stride(0), w_q.stride(0), w_s.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, IEEE=x.dtype == torch.float32,
        UPCAST=interpreting() and x.dtype == torch.bfloat16, SCALE_K=block_k, **cfg,
    )
    return y


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """True on CUDA devices of compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def block_fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, block_k: int, scale_rows: int,
                     bias: torch.Tensor | None = None, mode: str = "auto") -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(w_q, w_s)^T + bias, in x's dtype.  mode: "w8a8" quantises x per
    (row, block_k group) and runs the fp8 GEMM; "weight_only" keeps x as is; "auto" takes w8a8 where the
    GPU has FP8 tensor cores, else weight_only."""
    assert mode in ("auto", "w8a8", "weight_only"), f"unknown mode {mode!r}"
    if mode == "auto":
        mode = "w8a8" if has_fp8_tensor_cores(x.device) else "weight_only"
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if mode == "w8a8":
        x_q, x_s = per_token_group_quant_fp8(x2, block_k)
        y = w8a8_block_fp8_matmul(x_q, x_s, w_q, w_s, block_k, scale_rows, x.dtype, bias)
    else:
        y = weight_only_block_fp8_matmul(x2, w_q, w_s, block_k, scale_rows, x.dtype, bias)
    return y.view(*lead, y.shape[-1])


def dequantize_block_fp8(w_q: torch.Tensor, w_s: torch.Tensor, block_k: int, scale_rows: int) -> torch.Tensor:
    """w_q [N, K] e4m3|uint8, w_s [ceil(N/scale_rows), ceil(K/block_k)] -> fp32 [N, K]: each element times
    its block's scale (one fp32 multiply)."""
    n, k = w_q.shape
    w = w_q.view(torch.float8_e4m3fn).float()
    s = w_s.float().repeat_interleave(scale_rows, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
    return w * s
