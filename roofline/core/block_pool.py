"""BlockPool: the fixed set of KV blocks, their refcounts, the LRU free queue and the prefix-cache map.

A block with ref_cnt 0 sits in the free queue but keeps its content and hash: a later prefix hit
takes it back (touch), and only when it is handed out as a new block is its hash evicted.
Blocks are taken from the front of the free queue (least recently freed first); a freed block that
holds no reusable content (no hash) goes to the front so cached blocks live longer.
With `events` set (core/kv_events.KVEventRecorder, --kv-events-config), every hash that enters or leaves the
prefix-cache map, and every reset, is reported there.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from roofline.core.kv_events import KVEventRecorder


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, KVBlock] = {}
        self.events: Optional[KVEventRecorder] = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, block
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks given first are evicted first among equals."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def get_cached_block(self, block_hash: bytes) -> Optional[KVBlock]:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: bytes, parent: Optional[bytes] = None,
                    token_ids: Sequence[int] = (), lora_id: Optional[int] = None) -> None:
        """parent, token_ids, lora_id: what a BlockStored event reports (only read when events are on)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # same content already cached in another block; keep that one
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.stored(block_hash, parent, token_ids, lora_id)

    def reset_prefix_cache(self) -> None:
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()


class SwapPool:
    """Block ids of the CPU swap space (no caching, no sharing)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} swap blocks with only {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def release(self, block_ids: Iterable[int]) -> None:
        self.free.extend(block_ids)
