"""MLA attention backends: the latent cache's writes and reads, prefill by up-projection, decode absorbed.

Cache (kv_spec.mla_spec): one tensor per layer [1, num_blocks, block_size, 1, L + R]; a token's row is its
normalised latent c (L = kv_lora_rank values) followed by its roped shared key k_pe (R = qk_rope_head_dim).

Per head h the up-projection kv_b_proj gives k_nope_h = W_UK[h] c and v_h = W_UV[h] c
(W_UK [h, P, L], W_UV [h, V, L]; P = qk_nope_head_dim, V = v_head_dim), and the key is [k_nope_h, k_pe].

* Prefill chunks (query rows over a cached prefix + the chunk): the chunk's latents are written first,
  then the request's whole context 0..S is read back from the paged cache, up-projected
  (one GEMM, [S, L] x [L, h (P + V)]) and attended causally with ordinary per-head attention,
  query [q_nope, q_pe] of P + R, exactly the HF computation.
* Decodes (one query row each): the up-projections are absorbed.  q_nope . (W_UK c) = (W_UK^T q_nope) . c,
  so the query becomes q_abs = [W_UK[h]^T q_nope_h, q_pe_h] of width L + R and attends over the latent
  rows as ONE shared KV head (keys = the whole row, values = its first L entries); the head's output
  o_h = W_UV[h] (sum_t p_t c_t).  A decode step reads only the latent cache: (L + R) values per token
  for all heads, instead of h (P + V) + R after an up-projection.
Both paths compute the same function (tests compare them with each other and with HF).

Backends: 'torch' (the reference; CPU and CUDA), 'cpu' (decodes in the native latent-decode kernel,
cpu_ops.mla_decode), 'triton' (decodes in the split-KV Triton kernel, triton_decode.py; DSA's sparse decodes
in attention/sparse/triton_dsa.py).  Prefill runs the torch code in all three.  Under tensor parallelism each
rank holds its heads' W_UK / W_UV and the whole (replicated) latent cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from roofline.attention.backend import AttentionMetadata
from roofline.attention.sparse import dsa
from roofline.attention.sparse.dsa import TopkSelection
from roofline.cpu import dsa as cpu_dsa
from roofline.attention.torch_backend import TorchAttentionBackend


@dataclass
class MLAWeights:
    """This rank's slice of kv_b_proj, viewed per head: w_uk [h, P, L] (keys), w_uv [h, V, L] (values)."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    @classmethod
    def from_kv_b(cls, kv_b_weight: torch.Tensor, num_heads: int, nope_dim: int, v_dim: int) -> "MLAWeights":
        w = kv_b_weight.view(num_heads, nope_dim + v_dim, -1)
        return cls(w[:, :nope_dim], w[:, nope_dim:])


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` latent rows of one request, [length, L + R], read through its block table."""
    block_size = cache.shape[2]
    blocks = block_table[: -(-length // block_size)].long()
    return cache[0, blocks].reshape(-1, cache.shape[4])[:length]


class MLAAttentionBackend:
    """The torch reference; subclasses replace the decode path with native kernels."""

    name = "torch"

    def write_latent(self, latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """latent [N, L + R] (normalised latent, roped key) -> the cache rows at slot_mapping."""
        flat = cache.view(-1, cache.shape[4])
        flat.index_copy_(0, slot_mapping, latent.to(cache.dtype))

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                weights: MLAWeights, scale: float, selection: Optional[TopkSelection] = None) -> torch.Tensor:
        """q_nope [N, h, P], q_pe [N, h, R] -> [N, h, V]: decodes absorbed, prefill chunks up-projected.
        selection (DSA, attention/sparse): rows restricted to their kept positions; a step whose decodes are
        all unrestricted (contexts within index_topk) takes the dense decode path, exactly dense MLA."""
        n, h = q_nope.shape[:2]
        out = torch.empty((n, h, weights.w_uv.shape[1]), dtype=q_nope.dtype, device=q_nope.device)
        nd = meta.num_decodes
        if nd > 0:
            if selection is not None and selection.any_sparse(0, nd):
                out[:nd] = self.sparse_decode(q_nope[:nd], q_pe[:nd], cache, meta, weights, scale, selection)
            else:
                out[:nd] = self.decode(q_nope[:nd], q_pe[:nd], cache, meta, weights, scale)
        if meta.num_reqs > nd:
            self.prefill(q_nope, q_pe, cache, meta, weights, scale, out, selection)
        return out

    def sparse_decode(self, q_nope, q_pe, cache, meta: AttentionMetadata, weights: MLAWeights, scale: float,
                      selection: TopkSelection) -> torch.Tensor:
        """Decodes over only their kept latent rows (every row of a context within index_topk)."""
        nd = q_nope.shape[0]
        q_abs = self.absorb_query(q_nope, q_pe, weights)
        positions = dsa.decode_positions(selection, meta.seq_lens_cpu[:nd])
        o = dsa.sparse_latent_attention(q_abs, cache, meta.block_tables, positions, scale, weights.w_uk.shape[2])
        return self.absorb_output(o, weights)

    # ---- prefill: up-project the context, ordinary causal attention ----------------------------
    def prefill(self, q_nope, q_pe, cache, meta: AttentionMetadata, weights: MLAWeights, scale: float, out,
                selection: Optional[TopkSelection] = None) -> None:
        h, nope = weights.w_uk.shape[0], weights.w_uk.shape[1]
        lat = weights.w_uk.shape[2]
        w_kv = torch.cat((weights.w_uk, weights.w_uv), dim=1).reshape(-1, lat)  # kv_b_proj's weight
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for r in range(meta.num_decodes, meta.num_reqs):
            q0, q1, s = qsl[r], qsl[r + 1], lens[r]
            c = q1 - q0
            row = gather_latent(cache, meta.block_tables[r], s).to(q_nope.dtype)  # [S, L + R]
            kv = F.linear(row[:, :lat], w_kv).view(s, h, -1)  # [S, h, P + V]
            k = torch.cat((kv[..., :nope], row[:, None, lat:].expand(s, h, -1)), dim=-1)
            v = kv[..., nope:]
            q = torch.cat((q_nope[q0:q1], q_pe[q0:q1]), dim=-1)  # [C, h, P + R]
            q, k, v = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            qpos = torch.arange(s - c, s, device=q.device)[:, None]
            mask = torch.arange(s, device=q.device)[None, :] <= qpos  # row i (position s-c+i) sees 0..s-c+i
            if selection is not None:
                mask = dsa.prefill_mask(selection, q0, q1, mask)  # restricted rows: their kept positions
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)

    # ---- decode: absorbed into the query and the output ----------------------------------------
    @staticmethod
    def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, weights: MLAWeights) -> torch.Tensor:
        """[n, h, P], [n, h, R] -> q_abs [n, h, L + R] = [W_UK[h]^T q_nope_h, q_pe_h]."""
        q_lat = torch.einsum("nhp,hpl->nhl", q_nope, weights.w_uk.to(q_nope.dtype))
        return torch.cat((q_lat, q_pe), dim=-1).contiguous()

    @staticmethod
    def absorb_output(o_latent: torch.Tensor, weights: MLAWeights) -> torch.Tensor:
        """[n, h, L] -> [n, h, V]: each head's W_UV applied to its attention-weighted latent."""
        return torch.einsum("nhl,hvl->nhv", o_latent, weights.w_uv.to(o_latent.dtype))

    def decode(self, q_nope, q_pe, cache, meta: AttentionMetadata, weights: MLAWeights, scale: float):
        q_abs = self.absorb_query(q_nope, q_pe, weights)
        return self.absorb_output(self.latent_attention(q_abs, cache, meta, scale, weights.w_uk.shape[2]), weights)

    def latent_attention(self, q_abs: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         latent_rank: int) -> torch.Tensor:
        """q_abs [n, h, L + R] over each decode's latent rows (one shared head) -> [n, h, L]."""
        n, h, width = q_abs.shape
        block_size = cache.shape[2]
        out = torch.empty((n, h, latent_rank), dtype=q_abs.dtype, device=q_abs.device)
        flat = cache[0].view(cache.shape[1], block_size, width)
        plan = TorchAttentionBackend._decode_plan(meta, block_size, q_abs.device, q_abs.dtype)
        for rows, table, mask, nblocks in plan:
            k = torch.index_select(flat, 0, table).view(rows.shape[0], 1, nblocks * block_size, width)
            k = k.to(q_abs.dtype)
            o = F.scaled_dot_product_attention(q_abs[rows].unsqueeze(2), k, k[..., :latent_rank],
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[rows] = o.squeeze(2)
        return out


class CpuMLAAttentionBackend(MLAAttentionBackend):
    """Decodes' latent attention in the native kernel (cpu_ops.mla_decode); fp32 on the CPU, else torch."""

    name = "cpu"

    def latent_attention(self, q_abs, cache, meta, scale, latent_rank):
        from roofline.cpu import ops as cpu_ops

        if not cpu_ops.can_mla_decode(q_abs, cache):
            return super().latent_attention(q_abs, cache, meta, scale, latent_rank)
        nd = q_abs.shape[0]
        return cpu_ops.mla_decode(q_abs, cache, meta.block_tables[:nd], meta.seq_lens[:nd], latent_rank, scale)


    def sparse_decode(self, q_nope, q_pe, cache, meta, weights, scale, selection):
        """DSA's decodes in the native latent kernel over only their kept rows (cpu_dsa.sparse_mla_decode)."""
        q_abs = self.absorb_query(q_nope, q_pe, weights)
        if not (cpu_dsa.takes(q_abs, cache) and cache.is_contiguous()):
            return super().sparse_decode(q_nope, q_pe, cache, meta, weights, scale, selection)
        nd = q_nope.shape[0]
        positions = dsa.decode_positions(selection, meta.seq_lens_cpu[:nd])
        o = cpu_dsa.sparse_mla_decode(q_abs, cache, meta.block_tables, positions, scale, weights.w_uk.shape[2])
        return self.absorb_output(o, weights)


class TritonMLAAttentionBackend(MLAAttentionBackend):
    """Decodes' latent attention in the split-KV Triton kernel (triton_decode.py)."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits

    def latent_attention(self, q_abs, cache, meta, scale, latent_rank):
        from roofline.attention.mla import triton_decode

        nd = q_abs.shape[0]
        return triton_decode.mla_decode(q_abs, cache, meta.block_tables[:nd], meta.seq_lens[:nd], latent_rank,
                                        scale, max_seq_len=max(meta.seq_lens_cpu[:nd]), num_splits=self.num_splits)

    def sparse_decode(self, q_nope, q_pe, cache, meta, weights, scale, selection):
        """DSA's decodes in the Triton latent kernel over only their kept rows (triton_dsa.sparse_mla_decode)."""
        from roofline.attention.sparse import triton_dsa

        q_abs = self.absorb_query(q_nope, q_pe, weights)
        nd = q_nope.shape[0]
        positions = dsa.decode_positions(selection, meta.seq_lens_cpu[:nd])
        o = triton_dsa.sparse_mla_decode(q_abs, cache, meta.block_tables, positions, scale, weights.w_uk.shape[2])
        return self.absorb_output(o, weights)


_BY_NAME = {"torch": MLAAttentionBackend, "cpu": CpuMLAAttentionBackend, "triton": TritonMLAAttentionBackend}


def get_mla_backend(attention_backend) -> MLAAttentionBackend:
    """The MLA counterpart of the engine's resolved attention backend (get_attention_backend picked it
    for the device: 'torch', 'cpu' or 'triton')."""
    name = getattr(attention_backend, "name", attention_backend)
    if name not in _BY_NAME:
        raise ValueError(f"no MLA attention for backend {name!r}; one of {sorted(_BY_NAME)}")
    return _BY_NAME[name]()
