"""Routing policies: unit behaviour of round_robin / least_load / prefix_aware, and W3 over two replicas
behind the router: prefix_aware keeps the prefix-cache hit rate >= 0.9, round robin about half.

The W3 run uses two shared prefixes (W3's generator with seeds 1 and 2, 32 requests each, interleaved
in a seeded random order) and replicas whose KV pool holds one prompt's blocks and little more, so a
replica keeps one prefix cached at a time: routed by prefix, each replica always sees the same prefix;
routed in turn, a replica finds its cached prefix only when its previous request had the same one.
"""

from __future__ import annotations

import random

import pytest

from roofline.benchmarks.datasets import shared_prefix_requests
from roofline.metrics.prometheus import metric_value
from roofline.router.backends import Backend
from roofline.router.policies import LeastLoad, PrefixAware, RoundRobin, chain_hashes, make_policy, prompt_chunks
from tests.router.cluster import assert_kv_idle, completion, metrics, start_engine, start_router, stop

VOCAB = 384


def backends(n: int) -> list[Backend]:
    return [Backend(f"http://b{i}", "replica") for i in range(n)]


def test_round_robin_cycles():
    bs = backends(3)
    rr = RoundRobin()
    assert [rr.choose(bs, {}).url for _ in range(6)] == [b.url for b in bs] * 2


def test_least_load_takes_the_least_busy_and_spreads_ties():
    bs = backends(3)
    bs[0].in_flight, bs[1].reported_load, bs[2].in_flight = 2, 5, 1
    assert LeastLoad().choose(bs, {}).url == "http://b2"
    bs[2].in_flight = 2
    ll = LeastLoad()
    assert {ll.choose(bs, {}).url for _ in range(4)} == {"http://b0", "http://b2"}


def test_prompt_chunks_and_chain():
    body = {"prompt": list(range(40))}
    chunks = prompt_chunks(body, 16)
    assert len(chunks) == 2  # full chunks only
    assert chain_hashes(prompt_chunks({"prompt": list(range(32)) + [99] * 8}, 16)) == chain_hashes(chunks)
    assert chain_hashes(prompt_chunks({"prompt": [1] + list(range(1, 40))}, 16))[0] != chain_hashes(chunks)[0]
    text = prompt_chunks({"prompt": "x" * 130}, 16)
    assert len(text) == 2 and prompt_chunks({"prompt": ["x" * 130]}, 16) == text
    chat = prompt_chunks({"messages": [{"role": "user", "content": "y" * 200}]}, 16)
    assert len(chat) >= 3
    assert prompt_chunks({"prompt": [[1, 2], [3]]}, 16) == []


def test_prefix_aware_follows_the_prefix_until_overloaded():
    bs = backends(2)
    pa = PrefixAware(block_tokens=4, balance_threshold=3)
    a = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9]}
    first = pa.choose(bs, a)
    other = next(b for b in bs if b is not first)
    assert pa.choose(bs, {"prompt": [7, 7, 7, 7, 7]}) is other  # new prefix: least load (tie: the next one)
    for _ in range(3):
        assert pa.choose(bs, {"prompt": [1, 2, 3, 4, 5, 0, 0, 0, 0]}) is first  # shares the first chunk
    first.in_flight = 4  # overloaded beyond the threshold: the prefix moves
    assert pa.choose(bs, a) is other
    assert pa.choose(bs, {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 0]}) is other  # and stays where it went
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def w3_two_prefixes() -> list[list[int]]:
    reqs = [r.prompt for r in shared_prefix_requests(seed=1, num=32, vocab_size=VOCAB)]
    reqs += [r.prompt for r in shared_prefix_requests(seed=2, num=32, vocab_size=VOCAB)]
    random.Random(0).shuffle(reqs)
    return reqs


def prefix_cache_counts(replicas) -> tuple[float, float]:
    ms = [metrics(r.url) for r in replicas]
    return (sum(metric_value(m, "roofline:prefix_cache_hits_total") for m in ms),
            sum(metric_value(m, "roofline:prefix_cache_queries_total") for m in ms))


def hit_rate(policy: str, replicas) -> float:
    """W3 through a fresh router of `policy` over `replicas`: the prefix-cache hit rate of its requests
    (the replicas' counters before and after)."""
    router = start_router(replicas=[r.url for r in replicas], policy=policy, block_tokens=16)
    try:
        hits0, queries0 = prefix_cache_counts(replicas)
        for p in w3_two_prefixes():
            completion(router.url, p, 2)  # W3 asks 32 tokens out; the hit rate counts prompt tokens only
        assert_kv_idle(*replicas)
        hits, queries = prefix_cache_counts(replicas)
        return (hits - hits0) / (queries - queries0)
    finally:
        stop(router)


def test_w3_hit_rate_prefix_aware_vs_round_robin(tmp_path_factory):
    """Round robin first, on fresh replicas; then prefix_aware on the same replicas, each of which holds
    whichever prefix round robin sent it last (one prompt's blocks fit, so the first request of each prefix
    may miss)."""
    from tests.reference.hf_models import build_tiny_model

    path = str(tmp_path_factory.mktemp("tiny-llama-1k"))
    build_tiny_model("llama", path, seed=1, max_position_embeddings=1024)  # W3's 576 tokens fit
    replicas = [start_engine(path, num_kv_blocks=80) for _ in range(2)]  # 640 tokens: one 576-token request
    try:
        rr = hit_rate("round_robin", replicas)
        aware = hit_rate("prefix_aware", replicas)
    finally:
        stop(*replicas)
    print(f"W3 (two prefixes) over two replicas: prefix_aware hit rate {aware:.3f}, round_robin {rr:.3f}")
    assert aware >= 0.9
    assert 0.3 <= rr <= 0.65
