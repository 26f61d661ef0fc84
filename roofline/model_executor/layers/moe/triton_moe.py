"""The expert compute of a MoE layer on CUDA: a Triton grouped GEMM over expert-sorted rows.

The N x k (token, slot) rows are sorted by the expert they chose and each expert's run is padded to a
multiple of BLOCK_M (`align_by_expert`), so every BLOCK_M block of sorted rows belongs to one expert.
One kernel (`_grouped_gemm_kernel`) then computes, per block and BLOCK_N output columns, the block's
rows times that expert's weight, gathering its input rows through the sort and scattering the results
back to the rows' own places:

    gate_up [N*k, 2I] = x[token of row] @ w13[e]^T          (first launch; + b13[e] with expert biases)
    h = silu(gate) * up                                      (or the layer's ExpertActivation, in torch)
    y [N*k, H] = (h[row] @ w2[e]^T) * routing weight[row]    (second launch; + b2[e] before the weight)
    out [N, H] = y.view(N, k, H).sum(1)

Everything is sync-free (no .item(), sizes bounded from N alone), so it can be captured in a CUDA graph.
Tested against torch_experts under TRITON_INTERPRET=1 (tests/model_executor/test_moe_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """ids [N, k] -> (rows [P] int32: flat (token, slot) indices sorted by expert, each expert's run
    padded to a multiple of block_m with the sentinel N*k; block_expert [P / block_m] int32: the expert
    of each block, -1 past the used blocks).  P = the bound N*k + min(E, N*k) * (block_m - 1), rounded
    up to block_m, so no size depends on the values (no host sync)."""
    n, k = ids.shape
    nk = n * k
    device = ids.device
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in `order`
    sorted_experts = flat[order]
    dest = padded_start[sorted_experts] + torch.arange(nk, device=device) - first[sorted_experts]
    bound = nk + min(num_experts, nk) * (block_m - 1)
    bound = (bound + block_m - 1) // block_m * block_m
    rows = torch.full((bound,), nk, dtype=torch.int32, device=device)
    rows[dest] = order.to(torch.int32)
    block_start = torch.arange(0, bound, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, rows_ptr, block_expert_ptr, scale_ptr,
    num_rows, n_out, k_in, a_row_div,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    MUL_SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[row] = a[row // a_row_div] @ w[e]^T (* scale[row]) for the BLOCK_M sorted rows of one block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + offs_m)
    row_ok = rows < num_rows
    a_rows = rows // a_row_div
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = offs_k + k0 < k_in
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if MUL_SCALE:
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        acc = acc * scale[:, None]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _block_m(rows: int) -> int:
    return 16 if rows <= 64 else 64


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor, num_rows: int,
                 a_row_div: int, block_m: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """c [num_rows, w.shape[1]]: c[r] = a[r // a_row_div] @ w[e(r)]^T (* scale[r]) for the sorted rows."""
    n_out, k_in = w.shape[1], w.shape[2]
    a = a.contiguous()
    c = torch.empty((num_rows, n_out), dtype=a.dtype, device=a.device)
    block_n, block_k = (64, 32) if n_out >= 64 else (32, 32)
    grid = (block_expert.shape[0], triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, rows, block_expert, scale if scale is not None else c,
        num_rows, n_out, k_in, a_row_div,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), c.stride(0),
        MUL_SCALE=scale is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return c


def triton_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, activation=None, b13: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None) -> torch.Tensor:
    """As torch_experts.torch_experts (x [N, H], weights/ids [N, k] -> [N, H]; activation: a
    torch_experts.ExpertActivation, None for SiLU-and-mul; b13 / b2: the experts' biases, added to each
    row by its expert -- rows sit at their flat (token, slot) index -- before the routing weight)."""
    n, k = ids.shape
    if n == 0:
        return torch.zeros_like(x)
    block_m = _block_m(n * k)
    rows, block_expert = align_by_expert(ids, w13.shape[0], block_m)
    gate_up = grouped_gemm(x, w13, rows, block_expert, n * k, k, block_m)
    flat_ids = ids.reshape(-1)
    if b13 is not None:
        gate_up = gate_up + b13[flat_ids]
    if activation is None or activation.is_silu:
        inter = w2.shape[2]
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    else:
        h = activation(gate_up)
    scale = weights.reshape(-1).to(torch.float32)
    if b2 is None:
        y = grouped_gemm(h, w2, rows, block_expert, n * k, 1, block_m, scale=scale)
    else:  # the bias joins before the routing weight
        y = (grouped_gemm(h, w2, rows, block_expert, n * k, 1, block_m) + b2[flat_ids]) * scale[:, None].to(h.dtype)
    return y.view(n, k, -1).sum(dim=1)
