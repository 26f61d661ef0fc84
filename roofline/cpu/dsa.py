"""DeepSeek Sparse Attention on the CPU's native kernels, through ctypes: the indexer's scores and top-k
(dsa_kernels.c) and the latent attention over only the kept rows (cpu_kernels.c's mla_sparse_decode_f32).
attention/sparse/dsa.py holds the torch reference each is tested against and calls these on fp32 CPU tensors."""

from __future__ import annotations

import ctypes

import torch

from roofline.cpu import ops as cpu_ops

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
cpu_ops.declare("dsa_index_scores_f32", [_P, _P, _I, _I, _I, _P, _P, _I, _I, _I, _F, _P, ctypes.c_int])
cpu_ops.declare("dsa_topk_f32", [_P, _I, _I, _I, _P, ctypes.c_int])
cpu_ops.declare("mla_sparse_decode_f32", [_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, ctypes.c_int])


def takes(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors and the kernels loaded."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and cpu_ops.available()


def index_scores(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, first: int,
                 length: int, scale: float) -> torch.Tensor:
    """q [c, H, D], w [c, H] of consecutive tokens at positions first .. first + c - 1; cache the index keys
    [1, blocks, bs, 1, D] -> [c, length] scores (-inf past each row's position)."""
    c, heads, dim = q.shape
    q, w = q.contiguous(), w.float().contiguous()
    table = block_table.to(torch.int32).contiguous()
    out = torch.empty((c, length), dtype=torch.float32)
    cpu_ops.library().dsa_index_scores_f32(q.data_ptr(), w.data_ptr(), c, heads, dim, cache.data_ptr(),
                                           table.data_ptr(), cache.shape[2], first, length, scale, out.data_ptr(),
                                           torch.get_num_threads())
    return out


def topk_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [rows, S] -> [rows, k] int64: the positions of each row's k largest (any order; -1 past S)."""
    scores = scores.contiguous()
    rows, s = scores.shape
    out = torch.empty((rows, k), dtype=torch.int64)
    cpu_ops.library().dsa_topk_f32(scores.data_ptr(), rows, s, k, out.data_ptr(), torch.get_num_threads())
    return out


def sparse_mla_decode(q_abs: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
                      scale: float, latent_rank: int) -> torch.Tensor:
    """q_abs [n, h, L + R] over only each row's kept latent rows (positions [n, K], -1 past its count, the
    valid ones first) -> [n, h, L]."""
    n, h, width = q_abs.shape
    q_abs = q_abs.contiguous()
    positions = positions.contiguous()
    counts = (positions >= 0).sum(dim=1).to(torch.int32)
    tables = block_tables[:n].to(torch.int32).contiguous()
    out = torch.empty((n, h, latent_rank), dtype=torch.float32)
    cpu_ops.library().mla_sparse_decode_f32(q_abs.data_ptr(), out.data_ptr(), cache.data_ptr(), tables.data_ptr(),
                                            tables.stride(0), counts.data_ptr(), positions.data_ptr(),
                                            positions.stride(0), n, h, latent_rank, width, cache.shape[2], scale,
                                            torch.get_num_threads())
    return out
