"""The hybrid KV layout and its manager: layers cut into equal groups of one window each (plan_layout), one
block table per group from one pool, sliding groups giving back the blocks that left their window, prefix
hits that need only a sliding group's window, swap and fork with freed entries, and blocks_needed equal to
what an allocation takes."""

from __future__ import annotations

import random

import pytest

from roofline.attention import kv_spec
from roofline.core.hybrid_kv_cache_manager import NULL_BLOCK, HybridKVCacheManager
from roofline.core.request import Request
from roofline.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True))


def spec(window=0):
    return kv_spec.attention_spec(2, 16, window)


def test_gemma3_1b_layers_make_two_full_groups_and_eleven_sliding_ones():
    specs = [spec(0) if (i + 1) % 6 == 0 else spec(512) for i in range(26)]
    layout, why = kv_spec.plan_layout(specs)
    assert why == "" and layout.grouped
    assert sorted(layout.group_windows) == [0, 0] + [512] * 11
    assert len(layout.slot_specs) == 2 and all(s.sliding_window == 0 for s in layout.slot_specs)
    for g in range(layout.num_groups):  # two layers of one window per group, in slots 0 and 1
        members = [i for i in range(26) if layout.group_of_layer[i] == g]
        assert len(members) == 2 and {specs[i].sliding_window for i in members} == {layout.group_windows[g]}
        assert sorted(layout.slot_of_layer[i] for i in members) == [0, 1]


@pytest.mark.parametrize("specs,grouped,slots", [
    ([spec(), spec()], False, 2),                      # no windows: the identity
    ([spec(8)] * 4, True, 4),                          # every layer slides (Mistral v0.1): one group of 4
    ([spec(8), spec()] * 2, True, 2),                  # alternating (Gemma 2, gpt-oss): 2 groups of 2... x2
    ([spec(8), kv_spec.attention_spec(4, 16)], False, 2),  # different shapes: the identity
])
def test_layouts(specs, grouped, slots):
    layout, _ = kv_spec.plan_layout(specs)
    assert layout.grouped == grouped and len(layout.slot_specs) == slots
    caches = layout.layer_caches([object() for _ in layout.slot_specs])
    assert len(caches) == len(specs)


def test_a_sliding_group_gives_back_the_blocks_its_window_left():
    kv = HybridKVCacheManager(num_blocks=64, block_size=4, group_windows=[0, 6])
    r = req("a", list(range(30)))
    assert kv.allocate_slots(r, 30) is not None  # a whole prompt: every block of both groups while it runs
    assert [len([b for b in t if b is not None]) for t in kv.req_blocks["a"]] == [8, 8]
    r.num_computed_tokens = 30
    r.output_token_ids.append(7)
    free_before = kv.pool.num_free_blocks
    assert kv.blocks_needed(r, 1) == 0  # position 30 is in block 7, held; the window frees blocks 0..5
    kv.allocate_slots(r, 1)
    full, sliding = kv.get_group_block_ids("a")
    assert all(b is not None for b in kv.req_blocks["a"][0])  # the full group keeps every block
    assert [b is None for b in kv.req_blocks["a"][1]] == [True] * 6 + [False] * 2  # 30 - 6 + 1 = 25: block 6 on
    assert sliding[:6] == [NULL_BLOCK] * 6
    assert kv.pool.num_free_blocks == free_before + 6
    assert kv.get_block_ids("a") == full
    kv.free(r)
    assert kv.pool.num_free_blocks == 64


def test_blocks_needed_is_what_allocation_takes():
    """Random requests, chunk sizes, hits and frees: an allocation consumes exactly its planned net of free
    blocks (taken less given back), and blocks_needed is that net or 0."""
    rnd = random.Random(0)
    kv = HybridKVCacheManager(num_blocks=200, block_size=4, group_windows=[0, 5, 9, 0])
    live = []
    prefix = list(range(40))
    for step in range(300):
        if live and rnd.random() < 0.3:
            r = live.pop(rnd.randrange(len(live)))
            kv.free(r)
            continue
        if not live or rnd.random() < 0.3:
            r = req(f"r{step}", prefix[: rnd.randrange(4, 40)] + [1000 + step] * rnd.randrange(1, 20))
            hits, n_hit = kv.get_computed_blocks(r)
            chunk = min(rnd.randrange(1, 24), r.num_tokens - n_hit)
            need, net = kv.blocks_needed(r, chunk, hits), kv._plan(r, chunk, hits)[0]
            free = kv.pool.num_free_blocks
            if kv.allocate_slots(r, chunk, hits) is None:
                assert need > free
                continue
            assert free - kv.pool.num_free_blocks == net and need == max(net, 0)
            r.num_computed_tokens = n_hit + chunk
            live.append(r)
            continue
        r = rnd.choice(live)
        if r.num_computed_tokens >= r.num_tokens:
            r.output_token_ids.append(5)
        chunk = min(rnd.randrange(1, 12), r.num_tokens - r.num_computed_tokens)
        need, net, free = kv.blocks_needed(r, chunk), kv._plan(r, chunk, ())[0], kv.pool.num_free_blocks
        if kv.allocate_slots(r, chunk) is None:
            assert need > free
            continue
        # net: blocks taken less those the window gave back (negative when it gave back more)
        assert free - kv.pool.num_free_blocks == net and need == max(net, 0), (net, free, kv.pool.num_free_blocks)
        r.num_computed_tokens += chunk
        for g, table in enumerate(kv.req_blocks[r.request_id]):  # live exactly from the window's first block on
            first = kv.first_live(g, r.num_computed_tokens - chunk)
            assert all(b is not None for b in table[first:])
    for r in live:
        kv.free(r)
    assert kv.pool.num_free_blocks == 200


def test_a_prefix_hit_needs_only_the_sliding_groups_window():
    kv = HybridKVCacheManager(num_blocks=64, block_size=4, group_windows=[0, 6])
    a = req("a", list(range(33)))
    kv.allocate_slots(a, 33)
    a.num_computed_tokens = 33
    a.output_token_ids.append(1)
    kv.allocate_slots(a, 1)  # the sliding group drops blocks 0..5 (still cached, in the free queue)
    kv.free(a)
    b = req("b", list(range(33)) + [77])
    hits, n = kv.get_computed_blocks(b)
    assert n == 32
    assert all(h is not None for h in hits[0]) and [h is None for h in hits[1]] == [True] * 6 + [False] * 2
    assert kv.allocate_slots(b, 2, hits) is not None


def test_swap_out_and_in_keeps_freed_entries_freed():
    kv = HybridKVCacheManager(num_blocks=32, block_size=4, group_windows=[0, 5], num_swap_blocks=32)
    r = req("a", list(range(24)))
    kv.allocate_slots(r, 24)
    r.num_computed_tokens = 24
    r.output_token_ids.append(3)
    kv.allocate_slots(r, 1)
    shape = [[b is None for b in t] for t in kv.req_blocks["a"]]
    live = sum(1 for t in kv.req_blocks["a"] for b in t[:6] if b is not None)
    assert kv.can_swap_out(r)
    pairs = kv.swap_out(r)
    assert len(pairs) == live and kv.pool.num_free_blocks == 32
    back = kv.swap_in(r)
    assert len(back) == live
    assert [[b is None for b in t] for t in kv.req_blocks["a"]][0][:6] == shape[0][:6]
    kv.free(r)
    assert kv.pool.num_free_blocks == 32 and kv.swap_pool.num_free_blocks == 32


def test_fork_shares_blocks_and_copies_a_shared_partial_block_on_write():
    kv = HybridKVCacheManager(num_blocks=32, block_size=4, group_windows=[0, 5])
    parent, child = req("p", list(range(10))), req("c", list(range(10)))
    kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    kv.fork(parent, child, 10)
    child.num_computed_tokens = 10
    child.output_token_ids.append(4)
    kv.allocate_slots(child, 1)  # position 10 is in the shared partial block 2: copied first, in every group
    copies = kv.take_pending_copies()
    assert len(copies) == 2
    assert all(kv.req_blocks["p"][g][2] is not kv.req_blocks["c"][g][2] for g in range(2))
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 32


def test_capacity_counts_the_windows():
    kv = HybridKVCacheManager(num_blocks=100, block_size=4, group_windows=[0, 8, 8, 8])
    t = kv.capacity_tokens()
    assert kv.blocks_for_tokens(t) <= 100 < kv.blocks_for_tokens(t + 1)
    assert t > 100 * 4 // 4  # more than a plain pool of the same blocks over 4 groups would give


def test_without_chunked_prefill_a_prompt_the_pool_cannot_prefill_at_once_is_refused(tmp_path):
    """Sliding groups hold a whole prefill's blocks while it runs: with chunked prefill off, a prompt needing more
    than the pool in one chunk is an error at once, not a request that waits forever."""
    from roofline import LLM
    from tests.reference.hf_models import build_tiny_model

    build_tiny_model("gemma3", str(tmp_path), seed=1)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", show_progress=False, num_kv_blocks=4, block_size=8,
              enable_chunked_prefill=False, max_num_batched_tokens=512)
    try:
        with pytest.raises(ValueError, match="in one prefill"):
            llm.generate([{"prompt_token_ids": list(range(3, 60))}], SamplingParams(max_tokens=2))
        out = llm.generate([{"prompt_token_ids": list(range(3, 12))}], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks  # the refused prompt held none, the served one gave all back
    finally:
        llm.llm_engine.shutdown()
