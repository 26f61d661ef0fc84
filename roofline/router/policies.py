"""Replica selection policies.

  round_robin   each healthy backend in turn;
  least_load    the backend with the fewest requests: what the router has in flight there, or what
                the engine last reported (running + waiting, from its /metrics), whichever is larger;
  prefix_aware  the backend that served the longest leading part of this prompt before (so its prefix
                cache holds those blocks), unless it is overloaded; new prefixes go by least_load.
                The router does not tokenize: a prompt is cut into chunks (block_tokens token ids, or
                4 x block_tokens characters of text) and the chunks are hashed in a chain, like the
                engine's block hashes, so two prompts share a key exactly when they share the chunks.
"""

from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from typing import Any, Optional, Sequence

import xxhash

from roofline.router.backends import Backend

POLICIES = ("round_robin", "least_load", "prefix_aware")
CHARS_PER_TOKEN = 4  # text prompts: chunk by characters, about a block of tokens each


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, backends: Sequence[Backend], body: dict[str, Any]) -> Backend:
        return backends[next(self._counter) % len(backends)]


class LeastLoad:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, backends: Sequence[Backend], body: dict[str, Any]) -> Backend:
        low = min(b.load for b in backends)
        tied = [b for b in backends if b.load == low]
        return tied[next(self._counter) % len(tied)]


def prompt_chunks(body: dict[str, Any], block_tokens: int) -> list[bytes]:
    """The request's prompt cut into chunks (the router's stand-in for KV blocks), full chunks only."""
    prompt = body.get("prompt")
    if prompt is None and "messages" in body:
        prompt = json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        step = block_tokens * CHARS_PER_TOKEN
        data = prompt.encode()
        return [data[i:i + step] for i in range(0, len(data) - step + 1, step)]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return [json.dumps(prompt[i:i + block_tokens]).encode()
                for i in range(0, len(prompt) - block_tokens + 1, block_tokens)]
    return []


def chain_hashes(chunks: Sequence[bytes]) -> list[bytes]:
    out, parent = [], b""
    for c in chunks:
        parent = xxhash.xxh3_128(parent + c).digest()
        out.append(parent)
    return out


class PrefixAware:
    def __init__(self, block_tokens: int = 16, balance_threshold: int = 32, max_entries: int = 1 << 20) -> None:
        self.block_tokens = block_tokens
        self.balance_threshold = balance_threshold  # in-flight requests above the least loaded one
        self.max_entries = max_entries
        self.owner: OrderedDict[bytes, str] = OrderedDict()  # chunk chain hash -> backend url (LRU)
        self.fallback = LeastLoad()

    def choose(self, backends: Sequence[Backend], body: dict[str, Any]) -> Backend:
        hashes = chain_hashes(prompt_chunks(body, self.block_tokens))
        by_url = {b.url: b for b in backends}
        low = min(b.load for b in backends)
        chosen: Optional[Backend] = None
        for h in reversed(hashes):  # the longest known prefix first
            url = self.owner.get(h)
            b = by_url.get(url) if url is not None else None
            if b is not None and b.load <= low + self.balance_threshold:
                chosen = b
                break
        if chosen is None:
            chosen = self.fallback.choose(backends, body)
        for h in hashes:
            self.owner[h] = chosen.url
            self.owner.move_to_end(h)
        while len(self.owner) > self.max_entries:
            self.owner.popitem(last=False)
        return chosen


def make_policy(name: str, block_tokens: int = 16) -> Any:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "prefix_aware":
        return PrefixAware(block_tokens)
    raise ValueError(f"unknown routing policy {name!r}; one of {POLICIES}")
