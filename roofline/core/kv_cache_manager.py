"""KVCacheManager: each request's block table, prefix caching by chained block hash, fork with
copy-on-write, truncation, and swapping to the CPU pool.

Block hash of logical block i of a request:
    H_i = xxh3_128(H_{i-1} || token ids of block i || extra keys)     (H_{-1} = empty)
so equal hashes mean equal content *and* equal prefix.  Extra keys enter every hash: the LoRA adapter a
request runs under (its K/V differ from the base model's and from every other adapter's, so a prompt under
adapter A never reuses blocks computed under B or the base model) and the cache salt.
Only full blocks are hashed and shared; the partial last block is private unless forked, and a
write into a shared partial block first copies it (copy-on-write).

Recurrent state slots (models with linear-attention layers, attention/kv_spec.recurrent_spec): besides its
blocks a request holds one state slot (0 .. num_state_slots-1) from its first allocation until its blocks go
back (finish, abort, recompute preemption).  allocate_slots fails (None, nothing changed) when no slot is
free, like a short pool.  A fork cannot share a recurrent state (it is the state after the parent's last
token, not after the shared prefix): `can_fork` is False and the scheduler has the child recompute.
"""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

import xxhash

from roofline.core.block_pool import BlockPool, KVBlock, SwapPool
from roofline.core.request import Request


def hash_block(parent: Optional[bytes], token_ids: Sequence[int], extra: Optional[str],
               lora: Optional[str] = None) -> bytes:
    """extra: the cache salt; lora: the adapter's key (LoRARequest.cache_key), length-prefixed so that no
    salt can spell it."""
    h = xxhash.xxh3_128()
    if parent is not None:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    if lora:
        key = lora.encode()
        h.update(b"\x00lora:" + len(key).to_bytes(8, "little") + key)
    if extra:
        h.update(b"\x00salt:" + extra.encode())
    return h.digest()


class KVCacheManager:
    grouped = False  # one block table per request (HybridKVCacheManager: one per layer group)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_swap_blocks: int = 0,
        num_state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.free_state_slots: list[int] = list(range(num_state_slots - 1, -1, -1))  # popped from the end: 0 first
        self.req_state_slot: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.swap_pool = SwapPool(num_swap_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request registered in the cache
        self.swapped_blocks: dict[str, list[int]] = {}  # request -> CPU block ids
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), drained per step
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- recurrent state slots ----------------------------------------------------------------
    @property
    def can_fork(self) -> bool:
        """Whether a child may share its parent's computed prefix (not with recurrent state)."""
        return self.num_state_slots == 0

    def _state_slot_short(self, request: Request) -> bool:
        return (self.num_state_slots > 0 and request.request_id not in self.req_state_slot
                and not self.free_state_slots)

    def _take_state_slot(self, request: Request) -> None:
        if self.num_state_slots and request.request_id not in self.req_state_slot:
            self.req_state_slot[request.request_id] = self.free_state_slots.pop()

    def _free_state_slot(self, request_id: str) -> None:
        slot = self.req_state_slot.pop(request_id, None)
        if slot is not None:
            self.free_state_slots.append(slot)

    def get_state_slot(self, request_id: str) -> int:
        """The request's recurrent state slot; -1 when it holds none (or the model has no recurrent layers)."""
        return self.req_state_slot.get(request_id, -1)

    @property
    def num_free_state_slots(self) -> int:
        return len(self.free_state_slots)

    # ---- hashing -------------------------------------------------------------------------
    def compute_block_hashes(self, request: Request) -> list[bytes]:
        """The request's full-block prefix hashes (whether or not prefix caching is on)."""
        self._update_hashes(request)
        return request.block_hashes

    def _update_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        while len(hashes) < request.num_tokens // bs:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, request.all_token_ids[i * bs : (i + 1) * bs], request.cache_salt,
                                     request.lora_key))

    # ---- lookup / allocation ---------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute."""
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def blocks_needed(self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = ()) -> int:
        """Free blocks allocate_slots would consume (including a copy-on-write copy)."""
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(new_computed)
        need = max(need, 0)
        need += sum(1 for b in new_computed if b.ref_cnt == 0)  # touched blocks leave the free queue
        if self._cow_index(blocks, num_computed) is not None:
            need += 1
        return need

    def _cow_index(self, blocks: list[KVBlock], num_computed: int) -> Optional[int]:
        idx = num_computed // self.block_size
        if num_computed % self.block_size and idx < len(blocks) and blocks[idx].ref_cnt > 1:
            return idx
        return None

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed: Sequence[KVBlock] = (), register: bool = True
    ) -> Optional[list[KVBlock]]:
        """Give the request room for num_new_tokens more tokens after its computed ones.

        new_computed are prefix-cache hits found by get_computed_blocks (first scheduling only).
        register=False leaves the new full blocks out of the prefix cache (a KV load fills them later:
        register_computed once it has).
        Returns the newly allocated blocks, or None (nothing changed) when the pool is short.
        """
        if self.blocks_needed(request, num_new_tokens, new_computed) > self.pool.num_free_blocks:
            return None
        if self._state_slot_short(request):
            return None
        self._take_state_slot(request)
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        self.num_cached_blocks.setdefault(rid, 0)
        if new_computed:
            self.pool.touch(new_computed)
            blocks.extend(new_computed)
            self.num_cached_blocks[rid] = len(blocks)
        num_computed = request.num_computed_tokens + len(new_computed) * self.block_size
        cow = self._cow_index(blocks, num_computed)
        new_blocks: list[KVBlock] = []
        if cow is not None:
            (copy,) = self.pool.get_new_blocks(1)
            self.pending_copies.append((blocks[cow].block_id, copy.block_id))
            self.pool.free_blocks([blocks[cow]])
            blocks[cow] = copy
            new_blocks.append(copy)
        total = num_computed + num_new_tokens
        need = -(-total // self.block_size) - len(blocks)
        if need > 0:
            fresh = self.pool.get_new_blocks(need)
            blocks.extend(fresh)
            new_blocks.extend(fresh)
        if register:
            self._cache_full_blocks(request, min(total, request.num_tokens))
        return new_blocks

    def register_computed(self, request: Request, num_tokens: int) -> None:
        """The request's first num_tokens tokens now hold valid KV: offer its full blocks to the prefix cache."""
        self._cache_full_blocks(request, num_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        self._update_hashes(request)
        self._register_blocks(request, request.block_hashes, start, num_full)
        self.num_cached_blocks[rid] = num_full

    def _event_meta(self, request: Request, keys, i: int) -> dict:
        """What block i's BlockStored event reports (keys: the cache keys of the request's blocks); nothing
        when KV events are off."""
        if self.pool.events is None:
            return {}
        bs = self.block_size
        lora = request.lora_int_id
        return dict(parent=keys[i - 1] if i else None, token_ids=request.all_token_ids[i * bs:(i + 1) * bs],
                    lora_id=lora or None)

    def _register_blocks(self, request: Request, hashes: list[bytes], start: int, end: int) -> None:
        """Offer the request's blocks start .. end-1 to the prefix cache under their hashes."""
        blocks = self.req_blocks[request.request_id]
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i], **self._event_meta(request, hashes, i))

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so the tail is evicted first)."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._free_state_slot(rid)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
        swapped = self.swapped_blocks.pop(rid, None)
        if swapped:
            self.swap_pool.release(swapped)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # ---- fork / truncate --------------------------------------------------------------------
    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Child shares the parent's blocks covering its first num_tokens tokens (refcounts up)."""
        n = -(-num_tokens // self.block_size)
        shared = self.req_blocks[parent.request_id][:n]
        self.pool.touch(shared)
        self.req_blocks[child.request_id] = list(shared)
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_tokens // self.block_size
        )
        child.block_hashes = list(parent.block_hashes[: num_tokens // self.block_size])

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks covering the first num_tokens tokens (e.g. rejected draft tokens)."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        keep = -(-num_tokens // self.block_size)
        if keep < len(blocks):
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]
        full = num_tokens // self.block_size
        if self.num_cached_blocks.get(rid, 0) > full:
            self.num_cached_blocks[rid] = full
        del request.block_hashes[full:]

    # ---- swapping -----------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        if self.num_state_slots:  # a recurrent state is not in blocks: recompute (engines refuse swap mode)
            return False
        n = -(-request.num_computed_tokens // self.block_size)
        return n <= self.swap_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's computed blocks to the CPU pool. Returns (device, cpu) pairs."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.num_cached_blocks.pop(rid, None)
        n = -(-request.num_computed_tokens // self.block_size)
        cpu = self.swap_pool.allocate(n)
        pairs = [(blocks[i].block_id, cpu[i]) for i in range(n)]
        self.swapped_blocks[rid] = cpu
        self.pool.free_blocks(reversed(blocks))
        return pairs

    def swap_in(self, request: Request) -> Optional[list[tuple[int, int]]]:
        """Bring a swapped request back. Returns (cpu, device) pairs, or None if the pool is short."""
        rid = request.request_id
        cpu = self.swapped_blocks[rid]
        if len(cpu) > self.pool.num_free_blocks:
            return None
        blocks = self.pool.get_new_blocks(len(cpu))
        self.req_blocks[rid] = blocks
        # Swapped-in blocks are private copies; those already full are not registered again.
        self.num_cached_blocks[rid] = request.num_computed_tokens // self.block_size
        del self.swapped_blocks[rid]
        self.swap_pool.release(cpu)
        return [(c, b.block_id) for c, b in zip(cpu, blocks)]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def usage(self) -> float:
        return self.pool.usage()

    def capacity_tokens(self) -> int:
        """The longest single request the pool holds."""
        return self.pool.num_blocks * self.block_size
