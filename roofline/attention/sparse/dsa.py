"""DeepSeek Sparse Attention (DSA): which positions each query token attends to, as HF transformers'
`DeepseekV32Indexer` computes it, on the paged cache.

The indexer keeps one key per token (index_head_dim values, kv_spec.indexer_spec) in a cache tensor of its
own, addressed by the same block ids as the layer's MLA latent.  A query token at position p with index
queries q [H, D] (H = index_n_heads) and weights w [H] scores every position t <= p of its context:

    score(t) = sum_h w_h * relu(q_h . k_t * D^-0.5)          (w = weights_proj(x) * H^-0.5, in fp32)

and keeps the `index_topk` best.  A token whose context holds no more than index_topk positions keeps all of
them, so it attends exactly as dense MLA does (and its scores are never computed).  MLA then attends only to
the kept positions: prefill chunks through a mask (mla/backend.py), decodes by gathering only the kept
latent rows (`sparse_latent_attention`).

`select_topk` returns a TopkSelection for the step's flat rows: each row's kept positions ([N, K] int64, -1
past the end) and whether the row is restricted at all.  On fp32 CPU tensors the scores and the top-k run in
the native kernels (roofline/cpu/dsa.py: the keys read through the block table, never gathered), and the CPU
MLA backend's sparse decode in cpu_kernels.c's latent kernel over the kept rows only.  On CUDA tensors the
scores run in Triton (triton_dsa.py, the keys read through the block table too; the top-k in torch), and the
Triton MLA backend's sparse decode in triton_dsa's latent kernel.  The torch code here is the reference they
are tested against (and what other devices run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roofline.cpu import dsa as cpu_dsa

SCORE_ELEMENTS = 1 << 24  # rows x heads x context scored at once (bounds the temporary: 64 MB of fp32)


@dataclass
class TopkSelection:
    positions: torch.Tensor  # [N, K] int64: the kept positions of each restricted row (-1 elsewhere)
    sparse: torch.Tensor  # [N] bool: rows whose context is longer than index_topk (only these are restricted)
    topk: int

    def any_sparse(self, lo: int, hi: int) -> bool:
        return bool(self.sparse[lo:hi].any())


def write_index_keys(keys: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """keys [N, D] -> the indexer cache [1, blocks, block_size, 1, D] at slot_mapping."""
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, keys.to(cache.dtype))


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` rows [length, D] of one request's cache (latent or index keys), through its block table."""
    block_size = cache.shape[2]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[0, blocks].reshape(-1, cache.shape[-1])[:length]


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [c, H, D], w [c, H] (fp32), keys [s, D] -> [c, s] = sum_h w_h relu(q_h . k * scale), in fp32."""
    c, h, d = q.shape
    s = keys.shape[0]
    out = torch.empty((c, s), dtype=torch.float32, device=q.device)
    step = max(1, SCORE_ELEMENTS // max(h * s, 1))
    k = keys.float().t()
    for r0 in range(0, c, step):
        r1 = min(c, r0 + step)
        scores = torch.relu((q[r0:r1].float().reshape(-1, d) @ k).view(r1 - r0, h, s) * scale)  # [rows, H, s]
        out[r0:r1] = torch.bmm(w[r0:r1, None, :].float(), scores)[:, 0]
    return out


def select_topk(q: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, meta, topk: int,
                scale: float) -> TopkSelection:
    """q [N, H, D] index queries, w [N, H] head weights of the step's rows; cache the layer's index keys (this
    step's already written) -> each row's top-`topk` positions of its causal context."""
    n = q.shape[0]
    native = cpu_dsa.takes(q, cache) and cache.is_contiguous()
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    longest = max(lens[: meta.num_reqs]) if meta.num_reqs else 0
    positions = torch.full((n, max(min(topk, longest), 1)), -1, dtype=torch.int64, device=q.device)
    sparse = torch.zeros(n, dtype=torch.bool, device=q.device)
    for r in range(meta.num_reqs):
        q0, q1, s = qsl[r], qsl[r + 1], lens[r]
        if s <= topk:
            continue  # every row's context fits: dense
        first = s - (q1 - q0)
        lo = max(q0, q0 + topk - first)  # the first row whose context (position + 1) exceeds topk
        if native:  # the native kernels read the keys through the block table; same scores, same top-k set
            scores = cpu_dsa.index_scores(q[lo:q1], w[lo:q1], cache, meta.block_tables[r], first + lo - q0, s, scale)
            positions[lo:q1] = cpu_dsa.topk_positions(scores, topk)
        elif q.is_cuda:  # the Triton score kernel reads the keys through the block table too
            from roofline.attention.sparse import triton_dsa

            scores = triton_dsa.index_scores(q[lo:q1], w[lo:q1], cache, meta.block_tables[r], first + lo - q0, s,
                                             scale)
            positions[lo:q1] = scores.topk(topk, dim=-1).indices
        else:
            keys = gather_rows(cache, meta.block_tables[r], s)
            scores = index_scores(q[lo:q1], w[lo:q1], keys, scale)  # [rows, s]
            pos = torch.arange(first + lo - q0, s, device=q.device)
            scores.masked_fill_(torch.arange(s, device=q.device)[None, :] > pos[:, None], float("-inf"))
            positions[lo:q1] = scores.topk(topk, dim=-1).indices
        sparse[lo:q1] = True
    return TopkSelection(positions, sparse, topk)


def decode_positions(selection: TopkSelection, seq_lens: list[int]) -> torch.Tensor:
    """[nd, K] positions each decode row attends to: its kept positions, or (a context no longer than topk)
    all of them."""
    nd = len(seq_lens)
    pos = selection.positions[:nd]
    every = torch.arange(pos.shape[1], device=pos.device)[None, :]
    lens = torch.tensor(seq_lens, device=pos.device)[:, None]
    dense = torch.where(every < lens, every, -1)  # 0 .. s-1, then -1
    return torch.where(selection.sparse[:nd, None], pos, dense)


def sparse_latent_attention(q_abs: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                            positions: torch.Tensor, scale: float, latent_rank: int) -> torch.Tensor:
    """Absorbed MLA over only the kept latent rows: q_abs [n, h, L + R], positions [n, K] (-1: none) ->
    [n, h, L].  Reads K latent rows per decode, whatever its context."""
    n, h, width = q_abs.shape
    block_size = cache.shape[2]
    valid = positions >= 0
    pos = positions.clamp(min=0)
    blocks = torch.gather(block_tables[:n].long(), 1, pos // block_size)
    slots = blocks * block_size + pos % block_size  # [n, K]
    rows = cache.view(-1, width).index_select(0, slots.reshape(-1)).view(n, -1, width).to(q_abs.dtype)
    scores = torch.einsum("nhw,nkw->nhk", q_abs, rows) * scale
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("nhk,nkl->nhl", p, rows[..., :latent_rank])


def prefill_mask(selection: TopkSelection, q0: int, q1: int, causal: torch.Tensor) -> torch.Tensor:
    """The [c, s] attention mask of one prefill chunk's rows: causal, and for restricted rows their kept
    positions only."""
    rows = selection.sparse[q0:q1]
    if not bool(rows.any()):
        return causal
    kept = torch.zeros_like(causal)
    kept.scatter_(1, selection.positions[q0:q1].clamp(min=0), True)
    return torch.where(rows[:, None], kept & causal, causal)
