"""DataParallelScheduler: data-parallel attention's scheduling -- one Scheduler (requests, KV pool,
prefix cache) per DP rank behind the single Scheduler interface the engine core uses.

Every DP rank's workers hold their own KV cache and run their own batch; the MoE layers between them
run expert-parallel over all ranks (distributed/layout.py).  A step is one SchedulerOutput whose
`data_parallel` list holds each DP rank's own output (its block ids index that rank's pool) and whose
request lists are their concatenation, so the engine core treats it like any step; the workers run
their rank's part, and a rank with nothing to run joins the MoE layers' exchanges with no tokens (the
ranks step in lock step, see ModelRunner).

Placement: a new user request goes to the least-loaded DP rank (unfinished requests); among the ranks
within a small slack of the least load (a quarter of it, at least one request), the one whose prefix
cache already holds the longest prefix of the prompt wins, then the least loaded, then the next in
turn.  The n completions of one request stay on one rank (they share the prompt's blocks).
"""

from __future__ import annotations

from collections import ChainMap
from typing import Iterable, Optional

from roofline.core.request import Request, RequestStatus
from roofline.core.scheduler import Scheduler, SchedulerStats
from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class DataParallelScheduler:
    def __init__(self, schedulers: list[Scheduler]) -> None:
        if len(schedulers) < 2:
            raise ValueError("data-parallel scheduling needs at least two DP ranks")
        self.ranks = schedulers
        self.requests_assigned = [0] * len(schedulers)  # user requests placed on each rank so far
        self._turn = 0
        self.num_lookahead_slots = 0  # speculative decoding needs data_parallel_size 1 (config check)
        self.draft_length_policy = None
        self.kv_transfer = None  # KV connectors need data_parallel_size 1 (config check)
        self.step_count = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    # ---- intake -------------------------------------------------------------------------------
    def rank_holding(self, request_id: str) -> Optional[int]:
        """The DP rank whose scheduler holds this (unfinished) request, None if none does."""
        return next((d for d, s in enumerate(self.ranks) if request_id in s.requests), None)

    def add_request(self, request: Request) -> None:
        if self.rank_holding(request.request_id) is not None:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        # a later completion of an n > 1 request joins its siblings (they share the prompt's blocks)
        dp = next((d for d, s in enumerate(self.ranks)
                   if request.index and any(r.group_id == request.group_id for r in s.requests.values())), None)
        if dp is None:
            dp = self.choose_rank(request)
            self.requests_assigned[dp] += 1
        self.ranks[dp].add_request(request)

    def load(self, dp: int) -> int:
        """Unfinished engine requests on DP rank dp."""
        return len(self.ranks[dp].requests)

    def choose_rank(self, request: Request) -> int:
        """The DP rank for a new user request (module docstring)."""
        loads = [self.load(d) for d in range(self.size)]
        least = min(loads)
        slack = max(1, least // 4)
        near = [d for d in range(self.size) if loads[d] <= least + slack]
        hits = {d: self._cached_prefix_blocks(d, request) for d in near}
        start = self._turn
        self._turn = (self._turn + 1) % self.size
        return max(near, key=lambda d: (hits[d], -loads[d], -((d - start) % self.size)))

    def _cached_prefix_blocks(self, dp: int, request: Request) -> int:
        """Full blocks of the prompt's prefix in rank dp's prefix cache (no side effects)."""
        kv = self.ranks[dp].kv
        if not kv.enable_caching or request.skip_prefix_cache:
            return 0
        n = 0
        for h in kv.compute_block_hashes(request):
            if kv.pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Each rank finishes the ones it holds (a rank skips ids it does not know)."""
        ids = list(request_ids)
        return [r for s in self.ranks for r in s.finish_requests(ids, status)]

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.ranks)

    def take_finished_beam_groups(self) -> list:
        """The beam searches done on any rank since the last call (a search's beams live on one rank)."""
        return [g for s in self.ranks for g in s.take_finished_beam_groups()]

    # ---- views the engine reads ----------------------------------------------------------------
    @property
    def requests(self) -> ChainMap:
        return ChainMap(*(s.requests for s in self.ranks))

    @property
    def running(self) -> list[Request]:
        return [r for s in self.ranks for r in s.running]

    @property
    def waiting(self) -> list[Request]:
        return [r for s in self.ranks for r in s.waiting]

    @property
    def swapped(self) -> list[Request]:
        return [r for s in self.ranks for r in s.swapped]

    def kv_cache_usage(self) -> float:
        total = sum(s.kv.pool.num_blocks for s in self.ranks)
        return sum(s.kv_cache_usage() * s.kv.pool.num_blocks for s in self.ranks) / max(total, 1)

    def reset_prefix_cache(self) -> None:
        for s in self.ranks:
            s.reset_prefix_cache()

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self, max_requests: Optional[int] = None) -> SchedulerOutput:
        """Every DP rank schedules its own requests; one step carries all the parts."""
        parts = [s.schedule(max_requests) for s in self.ranks]
        self.step_count += 1
        return SchedulerOutput(
            step=self.step_count,
            new_requests=[n for p in parts for n in p.new_requests],
            scheduled=[s for p in parts for s in p.scheduled],
            finished_req_ids=[r for p in parts for r in p.finished_req_ids],
            blocks_to_copy=[], blocks_to_swap_out=[], blocks_to_swap_in=[],  # per pool: in the parts only
            data_parallel=parts)

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Each rank takes its part's results (a rank reads only its own requests' entries)."""
        return [t for s, part in zip(self.ranks, out.data_parallel) for t in s.update_from_output(part, result)]

    def get_stats(self) -> SchedulerStats:
        per = [s.get_stats() for s in self.ranks]
        return SchedulerStats(
            num_running=sum(p.num_running for p in per), num_waiting=sum(p.num_waiting for p in per),
            num_swapped=sum(p.num_swapped for p in per), kv_cache_usage=self.kv_cache_usage(),
            num_total_blocks=sum(p.num_total_blocks for p in per),
            num_free_blocks=sum(p.num_free_blocks for p in per),
            num_cached_blocks=sum(p.num_cached_blocks for p in per),
            prefix_cache_queries=sum(p.prefix_cache_queries for p in per),
            prefix_cache_hits=sum(p.prefix_cache_hits for p in per),
            num_preemptions=sum(p.num_preemptions for p in per),
            data_parallel_running=[p.num_running for p in per],
            data_parallel_waiting=[p.num_waiting + p.num_swapped for p in per],
            data_parallel_requests=list(self.requests_assigned))
