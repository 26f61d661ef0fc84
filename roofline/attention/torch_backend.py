"""Reference attention backend in plain torch (CPU and CUDA): the correctness baseline.

Decodes are batched: sorted by context length into up to 8 buckets, each bucket's K/V gathered
through the block tables into a padded [n x S_bucket] view and masked by length.  Each prefill chunk is computed on its own with a causal
mask offset by its cached prefix ([C x (S+C)] scores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roofline.attention.backend import AttentionBackend, AttentionMetadata, write_kv_torch


def _gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """K, V for one request: [length, H_kv, D] each, read through its block table."""
    block_size = kv_cache.shape[2]
    nblocks = (length + block_size - 1) // block_size
    blocks = block_table[:nblocks].long()
    k = kv_cache[0, blocks].reshape(-1, kv_cache.shape[3], kv_cache.shape[4])[:length]
    v = kv_cache[1, blocks].reshape(-1, kv_cache.shape[3], kv_cache.shape[4])[:length]
    return k, v


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        write_kv_torch(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        gqa = num_heads != num_kv_heads
        nd = meta.num_decodes
        if nd > 0:
            self._decode(query[:nd], kv_cache, meta, scale, out[:nd], gqa)
        if meta.num_reqs > nd:
            self._prefill(query, kv_cache, meta, scale, out, gqa)
        return out

    def _prefill(self, query, kv_cache, meta: AttentionMetadata, scale, out, gqa) -> None:
        """The prefill chunks (requests num_decodes .. R): each on its own, K/V gathered, SDPA."""
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for r in range(meta.num_decodes, meta.num_reqs):
            q0, q1, s = qsl[r], qsl[r + 1], lens[r]
            c = q1 - q0
            k, v = _gather_context(kv_cache, meta.block_tables[r], s)
            # 4-D [1, H, C, D]: SDPA's fused CPU kernel takes batched input only (3-D runs the math path)
            q = query[q0:q1].transpose(0, 1).unsqueeze(0)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
            if c == s:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                # Row i (position s-c+i) sees keys 0 .. s-c+i.
                qpos = torch.arange(s - c, s, device=query.device)[:, None]
                kpos = torch.arange(s, device=query.device)[None, :]
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=kpos <= qpos, scale=scale, enable_gqa=gqa
                )
            out[q0:q1] = o[0].transpose(0, 1).to(out.dtype)

    @staticmethod
    def _decode_plan(meta: AttentionMetadata, block_size: int, device, dtype):
        """Decodes sorted by context length and cut into up to 8 buckets, so the padded gather of
        each bucket wastes little; built once per step and shared by every layer."""
        plan = getattr(meta, "_torch_decode_plan", None)
        if plan is None:
            nd = meta.num_decodes
            lens = meta.seq_lens_cpu[:nd]
            order = sorted(range(nd), key=lens.__getitem__)
            nbuckets = max(1, min(8, nd // 8))
            size = -(-nd // nbuckets)
            plan = []
            for b in range(0, nd, size):
                rows = order[b : b + size]
                nblocks = -(-lens[rows[-1]] // block_size)
                rows_t = torch.tensor(rows, device=device)
                table = meta.block_tables[rows_t, :nblocks].reshape(-1).long()  # [n * nb]
                valid = torch.arange(nblocks * block_size, device=device)[None, :] < meta.seq_lens[rows_t, None]
                # additive float mask: SDPA's CPU kernel takes it ~15% faster than a boolean one
                mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
                plan.append((rows_t, table, mask[:, None, None, :], nblocks))  # mask [n, 1, 1, S]
            meta._torch_decode_plan = plan
        return plan

    def _decode(self, query, kv_cache, meta, scale, out, gqa) -> None:
        block_size, hk, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        for rows, table, mask, nblocks in self._decode_plan(meta, block_size, query.device, query.dtype):
            n = rows.shape[0]
            # [n, S, H_kv, D] -> [n, H_kv, S, D]
            k = torch.index_select(kv_cache[0], 0, table).view(n, nblocks * block_size, hk, d).transpose(1, 2)
            v = torch.index_select(kv_cache[1], 0, table).view(n, nblocks * block_size, hk, d).transpose(1, 2)
            q = query[rows].unsqueeze(2)  # [n, H, 1, D]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            out[rows] = o.squeeze(2).to(out.dtype)
