"""AttentionOptions (sliding window, logit soft-capping, sinks) on the torch reference and the native CPU
backend, against attention written out row by row in float64 over the same paged cache: mixed batches of
decodes, short verify-like requests and prefill chunks over cached prefixes, GQA, windows shorter than the
contexts, blocks wholly outside a window."""

import pytest
import torch

from roofline.attention.backend import AttentionOptions
from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.cpu import ops as cpu_ops
from tests.attention.paged_batches import make_batch

SPECS = [(0, 1), (6, 1), (45, 1), (10, 3), (0, 33), (20, 17)]  # (cached, new): decodes first


def dense_reference(meta, query, kv_cache, scale, options: AttentionOptions) -> torch.Tensor:
    block_size, hk = kv_cache.shape[2], kv_cache.shape[3]
    h = query.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for r in range(meta.num_reqs):
        q0, q1, s = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1], meta.seq_lens_cpu[r]
        blocks = meta.block_tables[r, : -(-s // block_size)].long()
        k = kv_cache[0, blocks].reshape(-1, hk, kv_cache.shape[4])[:s].double()
        v = kv_cache[1, blocks].reshape(-1, hk, kv_cache.shape[4])[:s].double()
        for i in range(q0, q1):
            pos = s - (q1 - i)
            lo = 0 if options.sliding_window is None else max(0, pos - options.sliding_window + 1)
            for head in range(h):
                kh = head // (h // hk)
                scores = (k[lo: pos + 1, kh] @ query[i, head].double()) * scale
                if options.logit_softcap is not None:
                    scores = torch.tanh(scores / options.logit_softcap) * options.logit_softcap
                if options.sinks is not None:
                    scores = torch.cat([scores, options.sinks[head].double().view(1)])
                p = torch.softmax(scores, dim=0)[: pos + 1 - lo]
                out[i, head] = p @ v[lo: pos + 1, kh]
    return out.float()


def option_sets(num_heads: int):
    sinks = torch.linspace(-1.0, 2.5, num_heads)
    return {
        "window": AttentionOptions(sliding_window=5),
        "window_of_a_block": AttentionOptions(sliding_window=16),
        "softcap": AttentionOptions(logit_softcap=2.0),
        "sinks": AttentionOptions(sinks=sinks),
        "all": AttentionOptions(sliding_window=9, logit_softcap=3.0, sinks=sinks),
    }


def backends():
    made = [TorchAttentionBackend()]
    if cpu_ops.available():
        from roofline.attention.cpu_backend import CpuAttentionBackend

        made.append(CpuAttentionBackend())
    return made


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("which", ["window", "window_of_a_block", "softcap", "sinks", "all"])
def test_options_match_attention_written_out(block_size, which):
    heads, kv_heads, d = 4, 2, 32
    meta, query, key, value, cache, _ = make_batch(SPECS, block_size=block_size, num_heads=heads,
                                                   num_kv_heads=kv_heads, head_dim=d, seed=block_size)
    query = query * 3  # scores large enough for the soft-cap to bend them
    options = option_sets(heads)[which]
    scale = d ** -0.5
    TorchAttentionBackend().write_kv(key, value, cache, meta.slot_mapping)
    want = dense_reference(meta, query, cache, scale, options)
    for backend in backends():
        got = backend.forward(query, cache, meta, scale, options)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m: f"{backend.name}: {m}")


def test_a_window_wider_than_every_context_is_plain_attention():
    heads, kv_heads, d = 4, 2, 32
    meta, query, key, value, cache, _ = make_batch(SPECS, block_size=8, num_heads=heads, num_kv_heads=kv_heads,
                                                   head_dim=d, seed=3)
    TorchAttentionBackend().write_kv(key, value, cache, meta.slot_mapping)
    for backend in backends():
        plain = backend.forward(query, cache, meta, 0.2)
        wide = backend.forward(query, cache, meta, 0.2, AttentionOptions(sliding_window=1000))
        torch.testing.assert_close(wide, plain, atol=1e-6, rtol=1e-6)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionOptions(sliding_window=0)
    with pytest.raises(ValueError, match="soft-cap"):
        AttentionOptions(logit_softcap=-1.0)


@pytest.mark.parametrize("which,split", [("all", None), ("window", True), ("softcap", True)])
def test_triton_backend_honours_the_options(which, split):
    """The Triton kernel (under the interpreter here): a window skips the key tiles before a tile's first
    row's window and masks both edges, on the plain and the split-KV path; the cap bends the score tiles;
    sinks seed the online softmax."""
    pytest.importorskip("triton")
    from roofline.attention.triton.backend import TritonAttentionBackend

    heads, kv_heads, d = 4, 2, 32
    specs = [(0, 1), (45, 1), (70, 1)] if split else [(6, 1), (45, 1), (10, 3), (20, 17)]
    meta, query, key, value, cache, _ = make_batch(specs, block_size=16, num_heads=heads, num_kv_heads=kv_heads,
                                                   head_dim=d, seed=7)
    query = query * 3
    options = option_sets(heads)[which]
    TorchAttentionBackend().write_kv(key, value, cache, meta.slot_mapping)
    want = dense_reference(meta, query, cache, d ** -0.5, options)
    got = TritonAttentionBackend(split_kv=split, num_splits=2, block_n=16).forward(query, cache, meta, d ** -0.5,
                                                                                  options)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
