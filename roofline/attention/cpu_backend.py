"""CPU attention backend: the torch backend with decodes and cache writes done by native kernels.

Decode rows (one query each) go to cpu_ops.paged_decode_attention, which reads K/V straight from
the paged cache through the block tables (no gather into a padded copy, no K/V repeat for GQA).
Prefill chunks go to cpu_ops.paged_prefill_attention: causal attention as two small GEMMs per
(request, KV head, tile of query rows) on the same register tiles as the projections, K/V read
through the block tables (~2.5x torch's SDPA on gathered copies at 64-256-token prompts); a request
of at most 8 rows (a decode verifying its drafts) attends there as that many decodes, each row bit for
bit a decode's at its causal length, its K and V read once for all its rows (faster than the tiles at
any context measured).  Cache
writes are one memcpy per token row.  Chosen by attention_backend="auto" on CPU whenever the kernels
load; fp32 only (anything else falls back to the torch code).  AttentionOptions (sliding window: blocks
wholly before a query's window are not read; soft-cap; sinks) go to the same kernels.
"""

from __future__ import annotations

from roofline.attention.backend import PLAIN, AttentionMetadata, AttentionOptions
from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.cpu import ops as cpu_ops


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_ops.available():
            raise ValueError("attention backend 'cpu' needs the native CPU kernels, which did not load "
                             "(no C compiler, or --no-cpu-kernels); use 'torch'")

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        if cpu_ops.can_write_kv(key, value, kv_cache):
            cpu_ops.write_kv(key, value, kv_cache, slot_mapping)
        else:
            super().write_kv(key, value, kv_cache, slot_mapping)

    def _prefill(self, query, kv_cache, meta: AttentionMetadata, scale, out, gqa,
                 options: AttentionOptions = PLAIN) -> None:
        if not cpu_ops.can_prefill(query, kv_cache):
            return super()._prefill(query, kv_cache, meta, scale, out, gqa, options)
        nd = meta.num_decodes
        cpu_ops.paged_prefill_attention(query, kv_cache, meta.block_tables[nd:], meta.query_start_loc[nd:],
                                        meta.seq_lens[nd:], scale, out, options)

    def _decode(self, query, kv_cache, meta: AttentionMetadata, scale, out, gqa,
                options: AttentionOptions = PLAIN) -> None:
        if not cpu_ops.can_decode(query, kv_cache):
            return super()._decode(query, kv_cache, meta, scale, out, gqa, options)
        nd = query.shape[0]
        cpu_ops.paged_decode_attention(query, kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, out=out,
                                       options=options)
