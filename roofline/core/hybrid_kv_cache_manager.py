"""HybridKVCacheManager: one block table per layer group (attention/kv_spec.py's plan_layout), all drawn from one
pool, so that sliding-window layers give back the blocks that left their window.

Group g has window W_g (0: full attention).  A step that computes positions from p0 on needs, in a sliding
group, only the blocks from  first_live(p0) = max(0, p0 - W_g + 1) // block_size  on: the blocks before go back
to the pool (they stay in the prefix cache until handed out again) and their table entries become NULL_BLOCK,
a placeholder no kernel reads (the attention kernels start at a query's window; the torch reference gathers
it and masks it).  Full groups keep every block, as KVCacheManager does.

Prefix caching: a full block is cached per group under (its prefix hash, group); a prompt hits n blocks when
every full group holds blocks 0 .. n-1 cached and every sliding group the ones its window needs
(first_live(n * block_size) .. n-1), so a sliding group's early blocks may long be gone.  Swapping moves a
request's live blocks of every group; recompute preemption frees them all.

The scheduler sees KVCacheManager's interface: `get_block_ids` is group 0's table, `get_group_block_ids`
every group's.
"""

from __future__ import annotations

from typing import Optional, Sequence

from roofline.core.block_pool import KVBlock
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.request import Request

NULL_BLOCK = 0  # the table entry of a block a sliding group gave back (never read)


class HybridKVCacheManager(KVCacheManager):
    grouped = True

    def __init__(self, num_blocks: int, block_size: int, group_windows: Sequence[int], enable_caching: bool = True,
                 num_swap_blocks: int = 0, num_state_slots: int = 0) -> None:
        super().__init__(num_blocks, block_size, enable_caching, num_swap_blocks, num_state_slots)
        if not group_windows:
            raise ValueError("a hybrid KV cache manager needs at least one group")
        self.group_windows = list(group_windows)
        # request -> per group its table: a KVBlock, or None where a sliding group gave the block back
        self.req_blocks: dict[str, list[list[Optional[KVBlock]]]] = {}
        self.live_from: dict[str, list[int]] = {}  # per request and group: table entries before it are None
        self.swapped_blocks: dict[str, list[list[Optional[int]]]] = {}
        self.swapped_live_from: dict[str, list[int]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def first_live(self, group: int, position: int) -> int:
        """The first block group `group` needs for queries at `position` and after."""
        w = self.group_windows[group]
        return 0 if not w else max(0, position - w + 1) // self.block_size

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks one request of num_tokens tokens holds at most over all groups (its last step's)."""
        n = -(-num_tokens // self.block_size)
        return sum(n - self.first_live(g, max(num_tokens - 1, 0)) for g in range(self.num_groups))

    def capacity_tokens(self) -> int:
        """The longest single request the pool holds at every step of its life.  blocks_for_tokens is a saw
        (a new block is taken at a block's first token, a window's block given back later in it), highest at
        each block's first token, and those peaks grow with the block index: the last block k whose first
        token fits holds the request to its end, (k + 1) * block_size tokens."""
        bs, n = self.block_size, self.pool.num_blocks
        if self.blocks_for_tokens(1) > n:
            return 0
        # with a full group, block n's first token needs n + 1 blocks; with sliding groups only, the peaks stop
        # growing past the window: any length fits (bounded here far past any max_model_len)
        lo, hi = 0, n if 0 in self.group_windows else 1024 * n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for_tokens(mid * bs + 1) <= n:
                lo = mid
            else:
                hi = mid - 1
        return (lo + 1) * bs

    @staticmethod
    def _key(block_hash: bytes, group: int) -> bytes:
        return block_hash + group.to_bytes(2, "little")

    # ---- lookup / allocation ---------------------------------------------------------------
    def get_computed_blocks(self, request: Request):
        """Per group the cached blocks of the longest usable prefix (None where a sliding group needs none),
        and the prefix's token count."""
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        found = [[self.pool.get_cached_block(self._key(h, g)) for h in hashes] for g in range(self.num_groups)]
        n = max_blocks
        for g in range(self.num_groups):  # full groups: the leading run of cached blocks
            if not self.group_windows[g]:
                run = 0
                while run < n and found[g][run] is not None:
                    run += 1
                n = run
        while n > 0 and not all(all(b is not None for b in found[g][self.first_live(g, n * self.block_size):n])
                                for g in range(self.num_groups) if self.group_windows[g]):
            n -= 1
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += n * self.block_size
        if n == 0:
            return [], 0
        hits = [[b if i >= self.first_live(g, n * self.block_size) else None for i, b in enumerate(found[g][:n])]
                for g in range(self.num_groups)]
        return hits, n * self.block_size

    def _plan(self, request: Request, num_new_tokens: int, new_computed) -> tuple[int, list[tuple[int, int]]]:
        """(blocks this allocation takes from the free queue, per group (first live block, blocks in all))."""
        tables = self.req_blocks.get(request.request_id)
        live_from = self.live_from.get(request.request_id)
        hit_tokens = len(new_computed[0]) * self.block_size if new_computed else 0
        start = request.num_computed_tokens + hit_tokens  # the step's first position
        total = -(-(start + num_new_tokens) // self.block_size)
        take, spans = 0, []
        for g in range(self.num_groups):
            table = tables[g] if tables else []
            first = self.first_live(g, start)
            spans.append((first, total))
            if new_computed:  # first scheduling: the table is empty, the hits fill its start
                hits = new_computed[g]
                take += sum(1 for b in hits[first:] if b.ref_cnt == 0)  # hits in the free queue leave it
                take += max(total - max(first, len(hits)), 0)
                continue
            take += sum(1 for i in range(max(first, len(table)), total))  # beyond the table
            take += sum(1 for i in range(first, min(len(table), total)) if table[i] is None)
            for i in range(live_from[g] if live_from else 0, min(first, len(table))):  # the window left these
                block = table[i]
                if block is not None and block.ref_cnt == 1:
                    take -= 1
            idx = start // self.block_size  # a write into a shared partial block copies it first
            if start % self.block_size and idx < len(table) and table[idx] is not None and table[idx].ref_cnt > 1:
                take += 1
        return take, spans

    def blocks_needed(self, request: Request, num_new_tokens: int, new_computed=()) -> int:
        return max(self._plan(request, num_new_tokens, new_computed)[0], 0)

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed=(), register: bool = True):
        need, spans = self._plan(request, num_new_tokens, new_computed)
        if need > self.pool.num_free_blocks or self._state_slot_short(request):
            return None
        self._take_state_slot(request)
        rid = request.request_id
        tables = self.req_blocks.setdefault(rid, [[] for _ in range(self.num_groups)])
        live_from = self.live_from.setdefault(rid, [0] * self.num_groups)
        self.num_cached_blocks.setdefault(rid, 0)
        start = request.num_computed_tokens + (len(new_computed[0]) * self.block_size if new_computed else 0)
        new_blocks: list[KVBlock] = []
        for g, (first, total) in enumerate(spans):
            table = tables[g]
            gone = []
            for i in range(live_from[g], min(first, len(table))):  # the window left these: back to the pool
                if table[i] is not None:
                    gone.append(table[i])
                    table[i] = None
            live_from[g] = max(live_from[g], first)
            self.pool.free_blocks(reversed(gone))
            if new_computed:
                hits = new_computed[g]
                self.pool.touch([b for b in hits[first:] if b is not None])
                table.extend(b if i >= first else None for i, b in enumerate(hits))
            idx = start // self.block_size
            if start % self.block_size and idx < len(table) and table[idx] is not None and table[idx].ref_cnt > 1:
                (copy,) = self.pool.get_new_blocks(1)  # copy-on-write of a shared partial block
                self.pending_copies.append((table[idx].block_id, copy.block_id))
                self.pool.free_blocks([table[idx]])
                table[idx] = copy
                new_blocks.append(copy)
        if new_computed:
            self.num_cached_blocks[rid] = len(new_computed[0])
        for g, (first, total) in enumerate(spans):
            table = tables[g]
            while len(table) < total:
                table.append(None)
            missing = [i for i in range(first, total) if table[i] is None]
            for i, block in zip(missing, self.pool.get_new_blocks(len(missing))):
                table[i] = block
                new_blocks.append(block)
        if register:
            self._cache_full_blocks(request, min(start + num_new_tokens, request.num_tokens))
        return new_blocks

    def _register_blocks(self, request: Request, hashes: list[bytes], start: int, end: int) -> None:
        """Every group's live blocks start .. end-1, each under (its hash, its group)."""
        for g, table in enumerate(self.req_blocks[request.request_id]):
            keys = {i: self._key(hashes[i], g) for i in range(max(start - 1, 0), end)}  # parent of start too
            for i in range(start, end):
                if table[i] is not None:
                    self.pool.cache_block(table[i], keys[i], **self._event_meta(request, keys, i))

    def free(self, request: Request) -> None:
        rid = request.request_id
        tables = self.req_blocks.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        self._free_state_slot(rid)
        self.live_from.pop(rid, None)
        if tables:
            for table in tables:
                self.pool.free_blocks(reversed([b for b in table if b is not None]))
        swapped = self.swapped_blocks.pop(rid, None)
        self.swapped_live_from.pop(rid, None)
        if swapped:
            self.swap_pool.release([c for table in swapped for c in table if c is not None])

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        return [[NULL_BLOCK if b is None else b.block_id for b in table] for table in self.req_blocks.get(request_id, ())]

    def get_block_ids(self, request_id: str) -> list[int]:
        tables = self.get_group_block_ids(request_id)
        return tables[0] if tables else []

    # ---- fork / truncate --------------------------------------------------------------------
    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        n = -(-num_tokens // self.block_size)
        tables = [list(table[:n]) for table in self.req_blocks[parent.request_id]]
        self.pool.touch([b for table in tables for b in table if b is not None])
        self.req_blocks[child.request_id] = tables
        self.live_from[child.request_id] = list(self.live_from.get(parent.request_id, [0] * self.num_groups))
        self.num_cached_blocks[child.request_id] = min(
            self.num_cached_blocks.get(parent.request_id, 0), num_tokens // self.block_size)
        child.block_hashes = list(parent.block_hashes[: num_tokens // self.block_size])

    def truncate(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        keep = -(-num_tokens // self.block_size)
        for table in self.req_blocks.get(rid, ()):
            if keep < len(table):
                self.pool.free_blocks(reversed([b for b in table[keep:] if b is not None]))
                del table[keep:]
        full = num_tokens // self.block_size
        if self.num_cached_blocks.get(rid, 0) > full:
            self.num_cached_blocks[rid] = full
        del request.block_hashes[full:]

    # ---- swapping -----------------------------------------------------------------------------
    def _live_computed(self, request: Request) -> list[list[Optional[KVBlock]]]:
        n = -(-request.num_computed_tokens // self.block_size)
        return [table[:n] for table in self.req_blocks.get(request.request_id, ())]

    def can_swap_out(self, request: Request) -> bool:
        if self.num_state_slots:
            return False
        live = sum(1 for table in self._live_computed(request) for b in table if b is not None)
        return live <= self.swap_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        rid = request.request_id
        computed = self._live_computed(request)
        cpu = iter(self.swap_pool.allocate(sum(1 for table in computed for b in table if b is not None)))
        pairs, swapped = [], []
        for table in computed:
            ids = []
            for b in table:
                if b is None:
                    ids.append(None)
                else:
                    c = next(cpu)
                    pairs.append((b.block_id, c))
                    ids.append(c)
            swapped.append(ids)
        tables = self.req_blocks.pop(rid, [])
        self.num_cached_blocks.pop(rid, None)
        live_from = self.live_from.pop(rid, None)
        self.swapped_blocks[rid] = swapped
        self.swapped_live_from[rid] = live_from or [0] * self.num_groups
        for table in tables:
            self.pool.free_blocks(reversed([b for b in table if b is not None]))
        return pairs

    def swap_in(self, request: Request):
        rid = request.request_id
        swapped = self.swapped_blocks[rid]
        count = sum(1 for table in swapped for c in table if c is not None)
        if count > self.pool.num_free_blocks:
            return None
        fresh = iter(self.pool.get_new_blocks(count))
        pairs, tables = [], []
        for ids in swapped:
            table: list[Optional[KVBlock]] = []
            for c in ids:
                if c is None:
                    table.append(None)
                else:
                    b = next(fresh)
                    pairs.append((c, b.block_id))
                    table.append(b)
            tables.append(table)
        self.req_blocks[rid] = tables
        self.live_from[rid] = self.swapped_live_from.pop(rid)
        self.num_cached_blocks[rid] = request.num_computed_tokens // self.block_size
        del self.swapped_blocks[rid]
        self.swap_pool.release([c for ids in swapped for c in ids if c is not None])
        return pairs
