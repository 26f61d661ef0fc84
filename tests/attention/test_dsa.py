"""DeepSeek Sparse Attention's pieces (attention/sparse/dsa.py, the native kernels of roofline/cpu/dsa.py):
the indexer keeps the top scores of each token's causal context, the native scores and top-k equal the torch
reference, and the sparse latent attention (torch and native) equals dense attention restricted to the kept
positions.  HF parity of the whole model: tests/model_executor/test_deepseek_v32.py."""

import pytest
import torch

from roofline.attention.backend import AttentionMetadata
from roofline.attention.sparse import dsa
from roofline.cpu import dsa as cpu_dsa, ops as cpu_ops

native = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable (no C compiler)")


def paged(rows: torch.Tensor, block_size: int, seed: int):
    """rows [S, D] laid into a shuffled paged cache -> (cache [1, blocks, bs, 1, D], block table [blocks])."""
    s, d = rows.shape
    nblocks = -(-s // block_size) + 2
    table = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed)).int()
    cache = torch.zeros(1, nblocks, block_size, 1, d)
    slots = torch.tensor([int(table[t // block_size]) * block_size + t % block_size for t in range(s)])
    dsa.write_index_keys(rows, cache, slots)
    return cache, table, slots


def chunk_meta(c: int, s: int, table: torch.Tensor, slots: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(num_tokens=c, num_reqs=1, num_decodes=0, query_start_loc=torch.tensor([0, c]),
                             seq_lens=torch.tensor([s]), block_tables=table[None], slot_mapping=slots[s - c:],
                             max_query_len=c, max_seq_len=s, query_start_loc_cpu=[0, c], seq_lens_cpu=[s])


def reference_scores(q, w, keys, first, scale):
    c = q.shape[0]
    out = torch.einsum("ch,cht->ct", w, torch.relu(torch.einsum("chd,td->cht", q.double(), keys.double()) * scale))
    pos = torch.arange(first, first + c)[:, None]
    return out.masked_fill(torch.arange(keys.shape[0])[None, :] > pos, float("-inf"))


def test_indexer_keeps_the_top_scores_of_the_causal_context():
    """Rows within topk are unrestricted; the others keep exactly the top index_topk positions t <= p of
    sum_h w_h relu(q_h . k_t * scale) (the native kernels where they load, else torch)."""
    g = torch.Generator().manual_seed(1)
    heads, d, topk, s, c = 4, 8, 5, 11, 7  # one prefill chunk: positions 4..10
    keys = torch.randn(s, d, generator=g)
    cache, table, slots = paged(keys, 4, seed=1)
    q, w = torch.randn(c, heads, d, generator=g), torch.randn(c, heads, generator=g)
    sel = dsa.select_topk(q, w, cache, chunk_meta(c, s, table, slots), topk, 0.5)
    want = reference_scores(q, w.double(), keys, s - c, 0.5)
    for i in range(c):
        p = s - c + i
        if p + 1 <= topk:
            assert not sel.sparse[i]
            continue
        assert sel.sparse[i] and set(sel.positions[i].tolist()) == set(want[i].topk(topk).indices.tolist())


@native
@pytest.mark.parametrize("rows,s,heads,d", [(1, 300, 16, 32), (9, 100, 4, 64), (3, 40, 64, 128),
                                             (120, 250, 20, 16)])  # passes of 32 rows; chunks no row reaches
def test_native_scores_and_topk_equal_the_reference(rows, s, heads, d):
    g = torch.Generator().manual_seed(rows * s)
    keys = torch.randn(s, d, generator=g)
    cache, table, _ = paged(keys, 16, seed=s)
    q, w = torch.randn(rows, heads, d, generator=g), torch.randn(rows, heads, generator=g)
    first = s - rows
    got = cpu_dsa.index_scores(q, w, cache, table, first, s, 0.125)
    want = reference_scores(q, w.double(), keys, first, 0.125)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    k = 10
    top = cpu_dsa.topk_positions(got, k)
    for r in range(rows):
        assert set(top[r].tolist()) == set(got[r].topk(k).indices.tolist())
    short = cpu_dsa.topk_positions(got[:1, :7], 10)  # fewer scores than k: all of them, then -1
    assert sorted(short[0, :7].tolist()) == list(range(7)) and short[0, 7:].tolist() == [-1] * 3


def sparse_case(seed: int = 0, h: int = 4, lat: int = 32):
    g = torch.Generator().manual_seed(seed)
    n, rope, bs, blocks = 3, 8, 4, 12
    cache = torch.randn(1, blocks, bs, 1, lat + rope, generator=g)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:8] for _ in range(n)]).int()
    lens = [30, 17, 9]
    positions = torch.full((n, 6), -1, dtype=torch.int64)
    for i, s in enumerate(lens):
        k = min(6, s) - (i == 1)  # a row with fewer kept positions than K
        positions[i, :k] = torch.randperm(s, generator=g)[:k]
    q = torch.randn(n, h, lat + rope, generator=g)
    return q, cache, tables, lens, positions, lat


def dense_over_kept(q, cache, tables, lens, positions, lat, scale):
    out = []
    for i, s in enumerate(lens):
        rows = dsa.gather_rows(cache, tables[i], s)  # the whole context ...
        keep = torch.zeros(s, dtype=torch.bool)
        keep[positions[i][positions[i] >= 0]] = True
        scores = (q[i] @ rows.T) * scale
        scores[:, ~keep] = float("-inf")  # ... restricted to the kept positions
        out.append(torch.softmax(scores, -1) @ rows[:, :lat])
    return torch.stack(out)


def test_sparse_latent_attention_is_dense_attention_over_the_kept_rows():
    q, cache, tables, lens, positions, lat = sparse_case()
    got = dsa.sparse_latent_attention(q, cache, tables, positions, 0.3, lat)
    torch.testing.assert_close(got, dense_over_kept(q, cache, tables, lens, positions, lat, 0.3), atol=1e-6, rtol=1e-5)


@native
@pytest.mark.parametrize("h,lat", [(4, 32), (22, 40)])  # 22 heads: blocks of 16 and 4 and single heads; L % 16
def test_native_sparse_decode_reads_only_the_kept_rows(h, lat):
    """The same function; and rows of the context that were not kept may hold anything (NaN here)."""
    q, cache, tables, lens, positions, lat = sparse_case(3, h, lat)
    want = dense_over_kept(q, cache, tables, lens, positions, lat, 0.3)
    kept = {int(tables[i, p // 4]) * 4 + p % 4 for i in range(len(lens)) for p in positions[i].tolist() if p >= 0}
    poisoned = cache.clone()
    flat = poisoned.view(-1, cache.shape[-1])
    for slot in range(flat.shape[0]):
        if slot not in kept:
            flat[slot] = float("nan")
    got = cpu_dsa.sparse_mla_decode(q, poisoned, tables, positions, 0.3, lat)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
