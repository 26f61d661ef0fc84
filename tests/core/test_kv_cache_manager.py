"""Unit tests of the KV-cache manager: chained hashes with extra keys, LRU reuse, fork and truncate."""

from __future__ import annotations

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.kv_cache_manager import KVCacheManager, hash_block
from roofline.core.request import Request
from roofline.core.scheduler import Scheduler
from roofline.sampling_params import SamplingParams


def req(rid, tokens, salt=None, **kw):
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True, **kw), cache_salt=salt)


def test_chained_hash_depends_on_parent_and_salt():
    a = hash_block(None, [1, 2], None)
    assert hash_block(None, [1, 2], None) == a
    assert hash_block(None, [1, 2], "tenant-a") != a
    assert hash_block(a, [3, 4], None) != hash_block(None, [3, 4], None)


def test_prefix_hit_and_salt_isolation():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    r1 = req("a", list(range(10)))
    assert kv.allocate_slots(r1, 10) is not None
    kv.free(r1)
    r2 = req("b", list(range(9)) + [99])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and len(hits) == 2
    r3 = req("c", list(range(10)), salt="other")
    assert kv.get_computed_blocks(r3) == ([], 0)


def test_lru_evicts_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old, new = req("old", [1, 2, 3]), req("new", [5, 6, 7])
    kv.allocate_slots(old, 3)
    kv.allocate_slots(new, 3)
    kv.free(old)
    kv.free(new)
    # a 3-block request evicts old's cached block before new's
    big = req("big", [9, 9, 9, 9, 9, 9])
    kv.allocate_slots(big, 6)
    kv.free(big)
    assert kv.get_computed_blocks(req("x", [5, 6, 0]))[1] == 2
    assert kv.get_computed_blocks(req("y", [1, 2, 0]))[1] == 0


def test_fork_copy_on_write_and_truncate():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, child = req("p", [1, 2, 3, 4, 5, 6]), req("c", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv.fork(parent, child, 5)
    shared = kv.get_block_ids("p")
    assert kv.get_block_ids("c") == shared
    child.num_computed_tokens = 5
    kv.allocate_slots(child, 1)  # writes position 5 inside the shared partial block
    copies = kv.take_pending_copies()
    assert copies == [(shared[1], kv.get_block_ids("c")[1])]
    assert kv.get_block_ids("c")[0] == shared[0]
    kv.truncate(child, 4)
    assert len(kv.get_block_ids("c")) == 1
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 8


def test_priority_policy_admits_lowest_value_first():
    sc = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8, max_model_len=100, policy="priority")
    s = Scheduler(sc, CacheConfig(block_size=4), num_blocks=32)
    for rid, prio in [("low", 5), ("high", 0), ("mid", 2)]:
        r = req(rid, [1, 2, 3, 4])
        r.priority = prio
        s.add_request(r)
    out = s.schedule()
    assert [x.req_id for x in out.scheduled] == ["high"]
