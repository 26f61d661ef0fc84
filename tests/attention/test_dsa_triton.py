"""DSA's Triton kernels (roofline/attention/sparse/triton_dsa.py) against the torch reference
(attention/sparse/dsa.py): the indexer's scores on a shuffled paged cache, the latent decode over only the
kept positions (rows not kept may hold NaN), and TritonMLAAttentionBackend's sparse decode against the torch
backend's.  Without a GPU through the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 set before the
kernels are defined)."""

import math

import pytest
import torch

from tests.triton_interpreter import interpret_without_gpu

interpret_without_gpu("roofline.attention.sparse.triton_dsa", "_index_scores_kernel")
pytest.importorskip("triton")

from roofline.attention.backend import AttentionMetadata  # noqa: E402
from roofline.attention.mla.backend import MLAAttentionBackend, MLAWeights, TritonMLAAttentionBackend  # noqa: E402
from roofline.attention.sparse import dsa, triton_dsa  # noqa: E402
from tests.attention import paged_batches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged(rows: torch.Tensor, block_size: int, seed: int, spare: int = 3):
    """rows [S, D] laid into a shuffled paged cache (spare blocks hold NaN) -> (cache, block table [blocks])."""
    s, d = rows.shape
    nblocks = -(-s // block_size) + spare
    table = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed)).int()
    cache = torch.full((1, nblocks, block_size, 1, d), float("nan"), dtype=rows.dtype)
    slots = torch.tensor([int(table[t // block_size]) * block_size + t % block_size for t in range(s)])
    dsa.write_index_keys(rows, cache, slots)
    return cache.to(DEVICE), table.to(DEVICE)


def reference_scores(q, w, keys, first, scale):
    """sum_h w_h relu(scale q_h . k_t) in float64, -inf past each row's position."""
    c = q.shape[0]
    per_head = torch.relu(torch.einsum("chd,td->cht", q.double(), keys.double()) * scale)
    out = torch.einsum("ch,cht->ct", w.double(), per_head)
    pos = torch.arange(first, first + c)[:, None]
    return out.masked_fill(torch.arange(keys.shape[0])[None, :] > pos, float("-inf"))


@pytest.mark.parametrize("rows,s,first,heads,d,block_h", [
    (6, 83, 77, 5, 24, None),  # a chunk ending the context; partial last key tile, 5 heads padded to 16
    (4, 50, 10, 20, 32, 16),  # rows early in a longer context (whole tiles past them); two head blocks
    (1, 37, 36, 3, 16, None),  # one decode row
])
def test_index_scores_equal_the_reference(rows, s, first, heads, d, block_h):
    g = torch.Generator().manual_seed(s + heads)
    keys = torch.randn(s, d, generator=g)
    cache, table = paged(keys, 8, seed=s)
    q, w = torch.randn(rows, heads, d, generator=g), torch.randn(rows, heads, generator=g)
    got = triton_dsa.index_scores(q.to(DEVICE), w.to(DEVICE), cache, table, first, s, 0.25, block_t=16,
                                  block_h=block_h).cpu()
    assert got.dtype == torch.float32 and got.shape == (rows, s)
    want = reference_scores(q, w, keys, first, 0.25)
    past = torch.arange(s)[None, :] > torch.arange(first, first + rows)[:, None]
    assert torch.equal(torch.isneginf(got), past)  # -inf exactly past each row's position
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    torch_scores = dsa.index_scores(q, w, keys, 0.25)  # the torch reference (unmasked) on the gathered keys
    torch.testing.assert_close(got[~past], torch_scores[~past], atol=1e-4, rtol=1e-4)


def test_index_scores_bf16_cache_accumulate_in_fp32():
    g = torch.Generator().manual_seed(5)
    s, rows, heads, d = 45, 3, 6, 32
    keys = torch.randn(s, d, generator=g).bfloat16()
    cache, table = paged(keys, 16, seed=5)
    q, w = torch.randn(rows, heads, d, generator=g).bfloat16(), torch.randn(rows, heads, generator=g)
    got = triton_dsa.index_scores(q.to(DEVICE), w.to(DEVICE), cache, table, s - rows, s, 0.2, block_t=16).cpu()
    torch.testing.assert_close(got.double(), reference_scores(q, w, keys, s - rows, 0.2), atol=2e-3, rtol=2e-3)


def sparse_case(seed: int, heads: int, counts, k: int, lat: int = 32, rope: int = 8, bs: int = 4):
    """Decode rows with counts[i] kept positions (the valid ones first, -1 after) of contexts of 60 tokens."""
    g = torch.Generator().manual_seed(seed)
    n, ctx, blocks = len(counts), 60, 40
    nblocks = -(-ctx // bs)
    cache = torch.randn(1, blocks, bs, 1, lat + rope, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:nblocks] for _ in range(n)]).int()
    positions = torch.full((n, k), -1, dtype=torch.int64)
    for i, c in enumerate(counts):
        positions[i, :c] = torch.randperm(ctx, generator=g)[:c]
    q = torch.randn(n, heads, lat + rope, generator=g)
    return q, cache, tables, positions, lat


def poison_unkept(cache, tables, positions, bs):
    """A copy of the cache with NaN in every row no decode kept."""
    kept = {int(tables[i, p // bs]) * bs + p % bs for i in range(positions.shape[0])
            for p in positions[i].tolist() if p >= 0}
    poisoned = cache.clone()
    flat = poisoned.view(-1, cache.shape[-1])
    for slot in range(flat.shape[0]):
        if slot not in kept:
            flat[slot] = float("nan")
    return poisoned


@pytest.mark.parametrize("heads,splits", [(5, 1), (5, 2), (20, None)])
def test_sparse_mla_decode_equals_the_reference_and_reads_only_kept_rows(heads, splits):
    """Rows with 1, 17, 33 and K (= 40) kept positions; h not a power of two (20: two head blocks)."""
    q, cache, tables, positions, lat = sparse_case(heads, heads, [1, 40, 17, 33], k=40)
    want = dsa.sparse_latent_attention(q, cache, tables, positions, 0.3, lat)
    poisoned = poison_unkept(cache, tables, positions, 4)
    got = triton_dsa.sparse_mla_decode(q.to(DEVICE), poisoned.to(DEVICE), tables.to(DEVICE), positions.to(DEVICE),
                                       0.3, lat, num_splits=splits, block_n=16)
    assert got.shape == (4, heads, lat) and got.dtype == q.dtype
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_sparse_mla_decode_bf16_cache():
    q, cache, tables, positions, lat = sparse_case(9, 4, [3, 24], k=24)
    q, cache = q.bfloat16(), cache.bfloat16()
    want = dsa.sparse_latent_attention(q.float(), cache.float(), tables, positions, 0.3, lat)
    got = triton_dsa.sparse_mla_decode(q.to(DEVICE), cache.to(DEVICE), tables.to(DEVICE), positions.to(DEVICE),
                                       0.3, lat, block_n=16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


H, P, V, L, R = 5, 16, 12, 32, 8  # heads, nope dim, value dim, latent rank, rope dim


def test_triton_backend_sparse_decode_equals_the_torch_backend(monkeypatch):
    """Three decodes, topk 16: contexts of 41 and 71 restricted to 16 kept positions, one of 3 (unrestricted,
    all of it); through forward(), which takes the sparse decode path."""
    topk = 16
    meta, q, _, _, kv, _ = paged_batches.make_batch([(40, 1), (2, 1), (70, 1)], block_size=8, num_heads=H,
                                                    num_kv_heads=1, head_dim=P + R, seed=2, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn((1,) + tuple(kv.shape[1:4]) + (L + R,), generator=g).to(DEVICE)
    kv_b = (torch.randn(H * (P + V), L, generator=g) / math.sqrt(L)).to(DEVICE)
    w = MLAWeights.from_kv_b(kv_b, H, P, V)
    positions = torch.full((3, topk), -1, dtype=torch.int64)
    sparse = torch.tensor([True, False, True])
    for i, s in enumerate(meta.seq_lens_cpu):
        if sparse[i]:
            positions[i] = torch.randperm(s, generator=g)[:topk]
    selection = dsa.TopkSelection(positions.to(DEVICE), sparse.to(DEVICE), topk)
    q_nope, q_pe = q[..., :P].contiguous(), q[..., P:].contiguous()
    calls = []
    kernel = triton_dsa.sparse_mla_decode
    monkeypatch.setattr(triton_dsa, "sparse_mla_decode", lambda *a, **k: calls.append(a[3]) or kernel(*a, **k))
    want = MLAAttentionBackend().forward(q_nope, q_pe, cache, meta, w, 0.3, selection)
    got = TritonMLAAttentionBackend().forward(q_nope, q_pe, cache, meta, w, 0.3, selection)
    assert len(calls) == 1 and calls[0][1].tolist() == [0, 1, 2] + [-1] * (topk - 3)  # the short context: all of it
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="select_topk takes the Triton scores on CUDA tensors")
def test_select_topk_on_cuda_keeps_the_reference_top_scores():
    g = torch.Generator().manual_seed(1)
    heads, d, topk, s, c = 8, 32, 20, 75, 9
    keys = torch.randn(s, d, generator=g)
    cache, table = paged(keys, 16, seed=1)
    q, w = torch.randn(c, heads, d, generator=g), torch.randn(c, heads, generator=g)
    slots = torch.zeros(c, dtype=torch.int64, device=DEVICE)
    meta = AttentionMetadata(num_tokens=c, num_reqs=1, num_decodes=0, query_start_loc=torch.tensor([0, c]),
                             seq_lens=torch.tensor([s]), block_tables=table[None], slot_mapping=slots,
                             max_query_len=c, max_seq_len=s, query_start_loc_cpu=[0, c], seq_lens_cpu=[s])
    sel = dsa.select_topk(q.to(DEVICE), w.to(DEVICE), cache, meta, topk, 0.5)
    want = reference_scores(q, w, keys, s - c, 0.5)
    for i in range(c):
        assert sel.sparse[i] and set(sel.positions[i].tolist()) == set(want[i].topk(topk).indices.tolist())
