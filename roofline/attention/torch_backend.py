"""Reference attention backend in plain torch (CPU and CUDA): the correctness baseline.

Decodes are batched: sorted by context length into up to 8 buckets, each bucket's K/V gathered
through the block tables into a padded [n x S_bucket] view and masked by length.  Each prefill chunk is computed on its own with a causal
mask offset by its cached prefix ([C x (S+C)] scores).

AttentionOptions: a sliding window narrows both masks; soft-capping and sinks, which SDPA cannot express, run the same attention in explicit math
(`attend_math`: scores, cap, mask, softmax with the sink column, values) -- HF's eager function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roofline.attention.backend import PLAIN, AttentionBackend, AttentionMetadata, AttentionOptions, write_kv_torch


def _gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """K, V for one request: [length, H_kv, D] each, read through its block table."""
    block_size = kv_cache.shape[2]
    nblocks = (length + block_size - 1) // block_size
    blocks = block_table[:nblocks].long()
    k = kv_cache[0, blocks].reshape(-1, kv_cache.shape[3], kv_cache.shape[4])[:length]
    v = kv_cache[1, blocks].reshape(-1, kv_cache.shape[3], kv_cache.shape[4])[:length]
    return k, v


def attend_math(q, k, v, allowed, scale: float, options: AttentionOptions) -> torch.Tensor:
    """Attention spelled out (HF's eager function): q [B, H, Lq, D], k/v [B, H_kv, S, D], allowed a boolean
    mask broadcasting to [B, H, Lq, S]; soft-capping and sinks as `options` say.  -> [B, H, Lq, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if options.logit_softcap is not None:
        scores = torch.tanh(scores / options.logit_softcap) * options.logit_softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if options.sinks is not None:
        sink = options.sinks.float().to(scores.device).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        write_kv_torch(key, value, kv_cache, slot_mapping)

    def forward(self, query, kv_cache, meta: AttentionMetadata, scale: float,
                options: AttentionOptions = PLAIN) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        gqa = num_heads != num_kv_heads
        nd = meta.num_decodes
        if nd > 0:
            self._decode(query[:nd], kv_cache, meta, scale, out[:nd], gqa, options)
        if meta.num_reqs > nd:
            self._prefill(query, kv_cache, meta, scale, out, gqa, options)
        return out

    def _prefill(self, query, kv_cache, meta: AttentionMetadata, scale, out, gqa,
                 options: AttentionOptions = PLAIN) -> None:
        """The prefill chunks (requests num_decodes .. R): each on its own, K/V gathered, SDPA."""
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for r in range(meta.num_decodes, meta.num_reqs):
            q0, q1, s = qsl[r], qsl[r + 1], lens[r]
            c = q1 - q0
            k, v = _gather_context(kv_cache, meta.block_tables[r], s)
            # 4-D [1, H, C, D]: SDPA's fused CPU kernel takes batched input only (3-D runs the math path)
            q = query[q0:q1].transpose(0, 1).unsqueeze(0)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, H_kv, S, D]
            if c == s and options.plain:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                # Row i (position s-c+i) sees keys first_key(s-c+i) .. s-c+i.
                qpos = torch.arange(s - c, s, device=query.device)[:, None]
                kpos = torch.arange(s, device=query.device)[None, :]
                allowed = (kpos <= qpos) & (kpos >= options.first_key(qpos))
                if options.logit_softcap is None and options.sinks is None:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
                else:
                    o = attend_math(q, k, v, allowed, scale, options)
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

    def _decode(self, query, kv_cache, meta, scale, out, gqa, options: AttentionOptions = PLAIN) -> None:
        block_size, hk, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        for rows, table, mask, nblocks in self._decode_plan(meta, block_size, query.device, query.dtype):
            n = rows.shape[0]
            # [n, S, H_kv, D] -> [n, H_kv, S, D]
            k = torch.index_select(kv_cache[0], 0, table).view(n, nblocks * block_size, hk, d).transpose(1, 2)
            v = torch.index_select(kv_cache[1], 0, table).view(n, nblocks * block_size, hk, d).transpose(1, 2)
            q = query[rows].unsqueeze(2)  # [n, H, 1, D]
            if options.plain:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
            else:  # the window's first key: seq_len - window (the query sits at seq_len - 1)
                kpos = torch.arange(nblocks * block_size, device=query.device)[None, :]
                last = meta.seq_lens[rows].long()[:, None] - 1
                allowed = ((kpos <= last) & (kpos >= options.first_key(last)))[:, None, None, :]
                if options.logit_softcap is None and options.sinks is None:
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
                else:
                    o = attend_math(q, k, v, allowed, scale, options)
            out[rows] = o.squeeze(2).to(out.dtype)
