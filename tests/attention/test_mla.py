"""MLA attention over the paged latent cache: the absorbed decode path against the up-projecting
prefill path and a per-token reference, the native CPU latent-decode kernel and the split-KV Triton
kernel (interpreted on CPU) against the torch path."""

import dataclasses
import math
import os

import pytest
import torch

from roofline.attention.mla.backend import (
    CpuMLAAttentionBackend,
    MLAAttentionBackend,
    MLAWeights,
    gather_latent,
    get_mla_backend,
)
from roofline.cpu import ops as cpu_ops
from tests.attention import paged_batches

H, P, V, L, R = 4, 16, 12, 32, 8  # heads, nope dim, value dim, latent rank, rope dim


def mla_batch(specs, block_size=16, heads=H, seed=0, device="cpu", dtype=torch.float32):
    meta, q, _, _, kv, _ = paged_batches.make_batch(specs, block_size=block_size, num_heads=heads, num_kv_heads=1,
                                                    head_dim=P + R, seed=seed, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1)
    n = q.shape[0]
    # the latent cache [1, blocks, bs, 1, L + R] over the batch's pool: random rows for the cached prefixes
    latent = torch.randn((1,) + tuple(kv.shape[1:4]) + (L + R,), generator=g).to(dtype).to(device)
    new_rows = torch.randn(n, L + R, generator=g).to(dtype).to(device)
    kv_b = torch.randn(heads * (P + V), L, generator=g).to(dtype).to(device) / math.sqrt(L)
    w = MLAWeights.from_kv_b(kv_b, heads, P, V)
    return meta, q[..., :P].contiguous(), q[..., P:].contiguous(), latent, new_rows, w


def reference(q_nope, q_pe, cache, meta, w, scale):
    """Per query row: up-project its visible latent rows and attend, one head at a time."""
    out = torch.empty(q_nope.shape[:2] + (V,), dtype=torch.float64)
    for r in range(meta.num_reqs):
        q0, q1, s = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1], meta.seq_lens_cpu[r]
        rows = gather_latent(cache, meta.block_tables[r], s).double()
        for i in range(q0, q1):
            pos = s - (q1 - q0) + (i - q0)
            c, kpe = rows[: pos + 1, :L], rows[: pos + 1, L:]
            for h in range(q_nope.shape[1]):
                k = torch.cat((c @ w.w_uk[h].double().T, kpe), dim=-1)
                v = c @ w.w_uv[h].double().T
                q = torch.cat((q_nope[i, h], q_pe[i, h])).double()
                out[i, h] = torch.softmax(k @ q * scale, 0) @ v
    return out


MIXED = [(20, 1), (47, 1), (5, 1), (33, 17), (0, 25)]  # 3 decodes, a chunk over a cached prefix, a prefill


@pytest.mark.parametrize("backend", [MLAAttentionBackend(), CpuMLAAttentionBackend()], ids=["torch", "cpu"])
def test_mixed_batch_matches_per_token_reference(backend):
    meta, q_nope, q_pe, cache, new_rows, w = mla_batch(MIXED)
    backend.write_latent(new_rows, cache, meta.slot_mapping)
    scale = 0.3
    got = backend.forward(q_nope, q_pe, cache, meta, w, scale)
    torch.testing.assert_close(got.double(), reference(q_nope, q_pe, cache, meta, w, scale), atol=1e-5, rtol=1e-5)


def test_absorbed_decode_equals_up_projected_prefill():
    """The same decode rows through both paths: absorbed (num_decodes) and as one-token prefill chunks."""
    meta, q_nope, q_pe, cache, new_rows, w = mla_batch([(30, 1), (64, 1), (0, 1), (17, 1)], seed=3)
    b = MLAAttentionBackend()
    b.write_latent(new_rows, cache, meta.slot_mapping)
    absorbed = b.forward(q_nope, q_pe, cache, meta, w, 0.25)
    up = b.forward(q_nope, q_pe, cache, dataclasses.replace(meta, num_decodes=0), w, 0.25)
    torch.testing.assert_close(absorbed, up, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels did not load (no C compiler)")
@pytest.mark.parametrize("heads,threads", [(4, 1), (16, 2), (3, 2), (22, 1)])
def test_native_latent_decode_matches_torch(heads, threads):
    specs = [(40, 1), (3, 1), (100, 1)] if threads == 2 else [(70, 1)]
    meta, q_nope, q_pe, cache, new_rows, w = mla_batch(specs, heads=heads, seed=heads)
    MLAAttentionBackend().write_latent(new_rows, cache, meta.slot_mapping)
    q_abs = MLAAttentionBackend.absorb_query(q_nope, q_pe, w)
    ref = MLAAttentionBackend().latent_attention(q_abs, cache, meta, 0.2, L)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.mla_decode(q_abs, cache, meta.block_tables, meta.seq_lens, L, 0.2)
    finally:
        torch.set_num_threads(prev)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_backend_follows_the_engine_backend_name():
    assert get_mla_backend("torch").name == "torch" and get_mla_backend("cpu").name == "cpu"
    with pytest.raises(ValueError, match="flash"):
        get_mla_backend("flash")


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("heads", [4, 20])
def test_triton_split_kv_decode_matches_torch(splits, heads):
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/attention/conftest.py
    from roofline.attention.mla.triton_decode import mla_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta, q_nope, q_pe, cache, new_rows, w = mla_batch([(40, 1), (2, 1), (70, 1)], heads=heads, seed=7, device=device)
    MLAAttentionBackend().write_latent(new_rows, cache, meta.slot_mapping)
    q_abs = MLAAttentionBackend.absorb_query(q_nope, q_pe, w)
    ref = MLAAttentionBackend().latent_attention(q_abs, cache, meta, 0.2, L)
    got = mla_decode(q_abs, cache, meta.block_tables, meta.seq_lens, L, 0.2, max_seq_len=meta.max_seq_len,
                     num_splits=splits)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
