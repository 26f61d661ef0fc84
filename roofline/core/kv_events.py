"""KV-cache events in vLLM's wire format: which blocks entered the prefix cache and which left it.

An endpoint picker's prefix-cache-aware scorer (the Gateway API Inference Extension / llm-d's KV-cache
indexer, Dynamo's KV router) keeps an index of the blocks each engine holds from these events, so a request is
routed to the engine that has most of its prefix.  The types are vLLM's (`vllm.distributed.kv_events`), field
for field and tag for tag, msgpack-encoded by msgspec as array-like tagged structs, so vLLM's own subscriber
decodes them unchanged:

  * `BlockStored`: blocks that just became reusable prefix blocks -- their hashes (in order, each the child of
    the one before; `parent_block_hash` the parent of the first), the tokens they hold, the block size, the
    LoRA adapter id they were computed under and the medium ("CPU" or "GPU": where the pool lives);
  * `BlockRemoved`: blocks whose content was evicted (their hashes);
  * `AllBlocksCleared`: the prefix cache was reset.

Our block hashes are bytes: xxh3-128 over (parent hash, token ids, adapter key, cache salt) --
kv_cache_manager.hash_block; a layer group's key under the hybrid layout (hybrid_kv_cache_manager._key).

`KVEventRecorder` is what the block pool reports to (BlockPool.events); the engine core drains it after every
step into one `KVEventBatch` for the publisher (engine/kv_event_publisher.py).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to the set of cached blocks (tagged with its class name on the wire, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the step's events were published
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


class KVEventRecorder:
    """Collects a step's events; consecutive stores that continue each other (one request's new blocks) are
    one BlockStored, consecutive removals one BlockRemoved."""

    def __init__(self, block_size: int, medium: Optional[str]) -> None:
        self.block_size = block_size
        self.medium = medium
        self.events: list[KVCacheEvent] = []

    def stored(self, block_hash: bytes, parent: Optional[bytes], token_ids: Sequence[int],
               lora_id: Optional[int]) -> None:
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and last.block_hashes[-1] == parent and last.lora_id == lora_id):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size, lora_id, self.medium))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
