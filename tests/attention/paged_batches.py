"""Paged attention batches for backend tests: a random cache, shuffled physical blocks, decodes first,
and a helper that runs a backend against the torch reference on the same batch."""

import math

import torch

from roofline.attention.backend import AttentionMetadata
from roofline.attention.torch_backend import TorchAttentionBackend


def make_batch(specs, *, block_size, num_heads, num_kv_heads, head_dim, dtype=torch.float32, seed=0,
               spare_blocks=3, qkv_view=False, device="cpu"):
    """specs: [(cached S_r, new C_r)], decodes (C_r == 1) first.

    Returns (meta, query, key, value, kv_cache, unused_blocks).  The cache is random everywhere
    (the cached prefixes are whatever is in their slots); the new tokens' K/V still have to be
    written through meta.slot_mapping.  Physical blocks are a random permutation of the pool.
    """
    g = torch.Generator().manual_seed(seed)
    nds = [c == 1 for _, c in specs]
    num_decodes = sum(nds)
    assert all(nds[:num_decodes]) and not any(nds[num_decodes:]), "decodes must come first"
    need = [math.ceil((s + c) / block_size) for s, c in specs]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(need) + 1  # a padded column, like a real table
    tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)
    used, slots, qsl, lens = 0, [], [0], []
    for r, (s, c) in enumerate(specs):
        phys = perm[used : used + need[r]]
        used += need[r]
        tables[r, : need[r]] = phys.to(torch.int32)
        for p in range(s, s + c):
            slots.append(int(phys[p // block_size]) * block_size + p % block_size)
        qsl.append(qsl[-1] + c)
        lens.append(s + c)
    unused = perm[used:]
    n = qsl[-1]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    if qkv_view:  # query as a strided view of a fused qkv projection (made on the device: .to() would copy it)
        qkv = torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(device)
        query = qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)
    else:
        query = torch.randn(n, num_heads, head_dim, generator=g).to(dtype)
    key = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(
        num_tokens=n,
        num_reqs=len(specs),
        num_decodes=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(c for _, c in specs),
        max_seq_len=max(lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return meta, query.to(device), key.to(device), value.to(device), kv_cache.to(device), unused


def run_both(meta, query, key, value, kv_cache, backend, scale=None):
    """Write the new K/V with each backend into its own copy of the cache, then attend."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    ref_cache, tri_cache = kv_cache.clone(), kv_cache.clone()
    ref = TorchAttentionBackend()  # its decode path is pure torch: the reference
    ref.write_kv(key, value, ref_cache, meta.slot_mapping)
    backend.write_kv(key, value, tri_cache, meta.slot_mapping)
    assert torch.equal(ref_cache, tri_cache)
    expected = ref.forward(query, ref_cache, meta, scale)
    got = backend.forward(query, tri_cache, meta, scale)
    return got, expected
