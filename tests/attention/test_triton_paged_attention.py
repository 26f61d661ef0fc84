"""Triton paged attention vs the torch reference backend.

Batches are built exactly as AttentionMetadata describes (decodes first, then prefill chunks over a
cached prefix), with shuffled, non-contiguous physical blocks.  Without a GPU the kernels run through
the Triton CPU interpreter (TRITON_INTERPRET=1, see conftest.py), so shapes stay tiny.
"""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton")

from roofline.attention.triton.backend import TritonAttentionBackend  # noqa: E402
from tests.attention import paged_batches  # noqa: E402
from tests.attention.paged_batches import run_both  # noqa: E402
from roofline.attention.backend import AttentionMetadata  # noqa: E402
from roofline.attention.torch_backend import TorchAttentionBackend  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def make_batch(specs, **kw):
    return paged_batches.make_batch(specs, device=DEVICE, **kw)


MIXED = [(20, 1), (47, 1), (5, 1), (33, 17), (0, 25)]  # 3 decodes, a chunk over a prefix, a fresh prefill


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1)])  # GQA 1, 4, 8
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_fp32(block_size, num_heads, num_kv_heads, head_dim):
    meta, q, k, v, cache, _ = make_batch(MIXED, block_size=block_size, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim, seed=block_size + head_dim)
    got, exp = run_both(meta, q, k, v, cache, TritonAttentionBackend(split_kv=False))
    torch.testing.assert_close(got, exp, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 64), (4, 4, 128)])
def test_mixed_batch_half(dtype, num_heads, num_kv_heads, head_dim):
    meta, q, k, v, cache, _ = make_batch(MIXED, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, dtype=dtype, seed=3)
    got, exp = run_both(meta, q, k, v, cache, TritonAttentionBackend(split_kv=False))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), exp.float(), **TOL[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(1, 1), (8, 2), (8, 1)])
def test_decode_only(block_size, num_heads, num_kv_heads):
    specs = [(70, 1), (0, 1), (15, 1), (32, 1)]  # includes a first-token decode (context 1)
    meta, q, k, v, cache, _ = make_batch(specs, block_size=block_size, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=64, seed=11)
    got, exp = run_both(meta, q, k, v, cache, TritonAttentionBackend(split_kv=False))
    torch.testing.assert_close(got, exp, **TOL[torch.float32])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_chunked_prefill_over_cached_prefix(num_heads, num_kv_heads, block_m):
    """One 70-token prompt in chunks of 24, 24, 22: each step attends over the cache written so far
    (chunks that are not a multiple of the query tile, several tiles per chunk with block_m=16)."""
    block_size, head_dim = 16, 64
    total, chunks = 70, [24, 24, 22]
    g = torch.Generator().manual_seed(1)
    num_blocks = 9
    phys = torch.randperm(num_blocks, generator=g)[:5].to(torch.int32)
    table = torch.zeros(1, 6, dtype=torch.int32)
    table[0, :5] = phys
    q_all = torch.randn(total, num_heads, head_dim, generator=g)
    k_all = torch.randn(total, num_kv_heads, head_dim, generator=g)
    v_all = torch.randn(total, num_kv_heads, head_dim, generator=g)
    ref_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE)
    tri_cache = ref_cache.clone()
    ref, tri = TorchAttentionBackend(), TritonAttentionBackend(block_m=block_m)
    done = 0
    for c in chunks:
        pos = list(range(done, done + c))
        slots = torch.tensor([int(phys[p // block_size]) * block_size + p % block_size for p in pos], device=DEVICE)
        meta = AttentionMetadata(
            num_tokens=c, num_reqs=1, num_decodes=0,
            query_start_loc=torch.tensor([0, c], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([done + c], dtype=torch.int32, device=DEVICE),
            block_tables=table.to(DEVICE), slot_mapping=slots, max_query_len=c, max_seq_len=done + c,
            query_start_loc_cpu=[0, c], seq_lens_cpu=[done + c],
        )  # fmt: skip
        q, k, v = (x[done : done + c].to(DEVICE) for x in (q_all, k_all, v_all))
        ref.write_kv(k, v, ref_cache, slots)
        tri.write_kv(k, v, tri_cache, slots)
        exp = ref.forward(q, ref_cache, meta, 0.125)
        got = tri.forward(q, tri_cache, meta, 0.125)
        torch.testing.assert_close(got, exp, **TOL[torch.float32])
        done += c
    assert torch.equal(ref_cache, tri_cache)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 16), (8, 1, 32)])
def test_split_kv_matches_non_split_decode(num_splits, num_heads, num_kv_heads, block_size):
    specs = [(99, 1), (36, 1), (63, 1)]  # few sequences; 8 splits leave some segments empty
    meta, q, k, v, cache, _ = make_batch(specs, block_size=block_size, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=64, seed=num_splits)
    split = TritonAttentionBackend(split_kv=True, num_splits=num_splits, block_n=16)
    assert split.choose_num_splits(meta, num_kv_heads, q.device) == num_splits
    got_split, exp = run_both(meta, q, k, v, cache, split)
    got_plain, _ = run_both(meta, q, k, v, cache, TritonAttentionBackend(split_kv=False, block_n=16))
    torch.testing.assert_close(got_split, got_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_split, exp, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_mixed_batch(dtype):
    """The split path is exact for prefill tiles too (rows can see no key in a late segment)."""
    meta, q, k, v, cache, _ = make_batch(MIXED, block_size=16, num_heads=8, num_kv_heads=2, head_dim=64,
                                         dtype=dtype, seed=21)
    got_split, exp = run_both(meta, q, k, v, cache, TritonAttentionBackend(split_kv=True, num_splits=4, block_n=16))
    got_plain, _ = run_both(meta, q, k, v, cache, TritonAttentionBackend(split_kv=False, block_n=16))
    torch.testing.assert_close(got_split.float(), got_plain.float(), **TOL[dtype])
    torch.testing.assert_close(got_split.float(), exp.float(), **TOL[dtype])


def test_split_kv_heuristic():
    def meta_for(specs):
        lens = [s + c for s, c in specs]
        qsl = [0]
        for _, c in specs:
            qsl.append(qsl[-1] + c)
        return AttentionMetadata(
            num_tokens=qsl[-1], num_reqs=len(specs), num_decodes=sum(c == 1 for _, c in specs),
            query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(lens), block_tables=torch.zeros(len(specs), 1),
            slot_mapping=torch.zeros(qsl[-1]), max_query_len=max(c for _, c in specs), max_seq_len=max(lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        )  # fmt: skip

    auto = TritonAttentionBackend()
    cpu = torch.device("cpu")  # heuristic assumes an H100-sized GPU (132 SMs) off-GPU
    few_long = meta_for([(8000, 1), (3000, 1)])
    assert auto.choose_num_splits(few_long, 8, cpu) > 1
    assert auto.choose_num_splits(meta_for([(100, 1), (50, 1)]), 8, cpu) == 1  # short contexts
    assert auto.choose_num_splits(meta_for([(8000, 1)] * 64), 8, cpu) == 1  # enough programs already
    assert auto.choose_num_splits(meta_for([(8000, 1), (0, 300)]), 8, cpu) == 1  # prefill present
    assert TritonAttentionBackend(split_kv=False).choose_num_splits(few_long, 8, cpu) == 1
    assert TritonAttentionBackend(split_kv=True, num_splits=8).choose_num_splits(meta_for([(5, 1)]), 8, cpu) == 8


def test_random_tables_never_read_outside_context():
    """NaN in every pool block no request owns and in the tail slots past each request's context:
    masked loads must keep them out (a single read would turn the output into NaN)."""
    block_size = 16
    specs = [(40, 1), (9, 1), (20, 13), (0, 7)]
    meta, q, k, v, cache, unused = make_batch(specs, block_size=block_size, num_heads=8, num_kv_heads=2,
                                              head_dim=64, seed=5, spare_blocks=4)
    ref = TorchAttentionBackend()
    ref.write_kv(k, v, cache, meta.slot_mapping)
    exp = ref.forward(q, cache, meta, 0.125)  # on the clean cache
    poisoned = cache.clone()
    poisoned[:, unused.to(DEVICE)] = float("nan")
    for r, s in enumerate(meta.seq_lens_cpu):
        n_blk = math.ceil(s / block_size)
        last = int(meta.block_tables[r, n_blk - 1])
        poisoned[:, last, s - (n_blk - 1) * block_size :] = float("nan")
    for split in (False, True):
        got = TritonAttentionBackend(split_kv=split, num_splits=2, block_n=16).forward(q, poisoned, meta, 0.125)
        assert not got.isnan().any()
        torch.testing.assert_close(got, exp, **TOL[torch.float32])


def test_strided_query_and_odd_tiles():
    """Query as a view of a fused qkv buffer; BLOCK_M 16 with GQA 8 (2 tokens per tile)."""
    meta, q, k, v, cache, _ = make_batch([(3, 1), (16, 19), (31, 2)], block_size=32, num_heads=8, num_kv_heads=1,
                                         head_dim=64, seed=9, qkv_view=True)
    assert not q.is_contiguous()
    got, exp = run_both(meta, q, k, v, cache, TritonAttentionBackend(block_m=16, block_n=32))
    torch.testing.assert_close(got, exp, **TOL[torch.float32])
