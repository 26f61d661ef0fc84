"""Scheduler: iteration-level continuous batching with a token budget, chunked prefill,
prefix-cache hits, preemption (recompute or swap), FCFS or priority order.  No tensors.

Every step:
  0. the step's token budget: max_num_batched_tokens, or, with the ITL budget on (core/step_budget.py,
     --target-itl-ms), the running decodes' tokens plus the prefill tokens that keep the step's predicted
     time within the target (at most max_num_batched_tokens, at least a minimum chunk of prefill).
  1. running requests, oldest first, each gets min(remaining tokens, budget) new tokens
     (a decode: 1; a prefill in progress: the next chunk, within the step's prefill tokens, so that the
     decodes' tokens stay reserved).  When the pool is short, the lowest-priority / most recently admitted
     running request is preempted until it fits.
  2. swapped requests come back if nothing was preempted this step and the pool has room.
  3. waiting requests are admitted while budget, max_num_seqs and free blocks allow; their
     prompt starts after the longest cached prefix.

Speculative decoding (the multi-token step): a decoding request that carries proposed tokens
(`Request.spec_token_ids`, from the workers' previous step) is scheduled for 1 + k tokens, k at most
the step's draft length (chosen per step by the DraftLengthPolicy), the budget, max_tokens and
max_model_len allow.  The runner returns the accepted drafts plus one token of its own; the request
advances by 1 + accepted, and the blocks past its known tokens (rejected drafts, lookahead slots for
a draft model's own proposals) go back to the pool.  Drafts are never in all_token_ids before they are
accepted, so they never enter the prefix cache.

Batches in flight (pipeline parallelism): a step may be scheduled before the previous ones have
returned.  `in_flight` counts, per request, the steps that carry it and have not come back through
update_from_output; such a request is neither scheduled again (its next token is not known yet) nor
preempted (a stage may still write its blocks), so no token is ever scheduled twice.
`schedule(max_requests=...)` caps a step's requests, so that the engine can spread the running
requests over as many batches as the pipeline holds.

Beam search (use_beam_search, core/beam_search.py): a request starts as one beam, an ordinary request that
samples greedily and returns its top 2W logprobs.  A beam's sampled token is never appended: the beam is
*parked* (out of `running`, keeping its blocks) until every live beam of its search has reported, then the
search's step continues it with the chosen token (its first child), forks it for further children (the
child shares every block, the partial last one copy-on-write) or ends it.  Continued and forked beams
queue at the front of `waiting` holding their blocks, so each step of a beam feeds one new token.  Under
memory pressure a parked beam, like a waiting one, gives its blocks up and recomputes later (from the
prefix cache).  Parked beams hold no place in the running batch, so beams never wait on each other for one.

LoRA adapters (roofline/lora): the running requests use at most max_loras distinct adapters (the slots the
workers hold), so every step fits.  A waiting or swapped request under another adapter waits while that
many are running; requests behind it under a running adapter or the base model go ahead.

The ITL budget with the other features: a decode's drafts (speculative decoding) count as decode tokens, the
draft length chosen first; beams and forked siblings waiting for their next single token count as decodes;
with batches in flight (pipeline parallelism) each batch is planned with its own decodes (requests in flight
are not in it); LoRA and KV transfer change nothing (a request that loads its KV has no prompt left to
prefill).  It does not apply without chunked prefill (a prompt goes whole) nor under data-parallel attention
(dp_scheduler.py: every rank's step runs in lock step with the others', so one rank's shape does not predict
the step's time); the engine gives no budget there and the cap alone holds.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from roofline.config import CacheConfig, SchedulerConfig
from roofline.core.beam_search import BeamGroup, BeamSearch
from roofline.core.hybrid_kv_cache_manager import HybridKVCacheManager
from roofline.core.kv_cache_manager import KVCacheManager
from roofline.core.kv_connector import KVConnectorScheduler
from roofline.core.kv_transfer_tracker import KVTransferTracker
from roofline.core.request import Request, RequestStatus
from roofline.core.spec_decode_stats import SpecDecodeStats
from roofline.core.step_budget import StepBudget, StepPlan
from roofline.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    PositionLogprobs,
    SamplingSpec,
    ScheduledRequest,
    SchedulerOutput,
)


SEED_MASK = 2**63 - 1


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    spec_decode: Optional["SpecDecodeStats"] = None
    # data-parallel attention (dp_scheduler.py): per DP rank, requests running / waiting now and user
    # requests placed so far; empty with one rank
    data_parallel_running: list[int] = field(default_factory=list)
    data_parallel_waiting: list[int] = field(default_factory=list)
    data_parallel_requests: list[int] = field(default_factory=list)


def sampling_spec(request: Request) -> SamplingSpec:
    p = request.sampling_params
    if p.use_beam_search:  # a beam: the raw distribution's top 2W logprobs (the token drawn is not used)
        return SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                            presence_penalty=0.0, frequency_penalty=0.0, seed=None, min_tokens=0, stop_token_ids=[],
                            logprobs=2 * p.n, prompt_logprobs=None)
    return SamplingSpec(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed,
        min_tokens=p.min_tokens,
        stop_token_ids=([] if p.ignore_eos or request.eos_token_id is None else [request.eos_token_id])
        + list(p.stop_token_ids),
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        structured=request.grammar is not None,
    )


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_swap_blocks: int = 0,
        seed: int = 0,
        draft_length_policy=None,
        num_lookahead_slots: int = 0,
        kv_connector: Optional[KVConnectorScheduler] = None,
        kv_group_windows: Sequence[int] = (),
        max_loras: Optional[int] = None,
        num_state_slots: int = 0,
        step_budget: Optional[StepBudget] = None,
    ) -> None:
        """kv_group_windows: the block-table groups of a hybrid KV layout (their sliding windows, 0: full);
        empty: one table per request (KVCacheManager).  num_state_slots: recurrent-state slots (models with
        linear-attention layers; one per request that may run), handed out and taken back with the blocks.
        step_budget: the per-step token budget from the step-time estimate (None: max_num_batched_tokens
        every step; ignored without chunked prefill, where a prompt must fit whole)."""
        self.config = scheduler_config
        self.max_loras = max_loras  # distinct LoRA adapters among the running requests (None: no LoRA)
        self.block_size = cache_config.block_size
        if kv_group_windows:
            self.kv = HybridKVCacheManager(num_blocks, cache_config.block_size, kv_group_windows,
                                           cache_config.enable_prefix_caching, num_swap_blocks, num_state_slots)
        else:
            self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                     num_swap_blocks, num_state_slots)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.finished_req_ids: list[str] = []  # to tell the workers at the next step
        self.sent_to_worker: set[str] = set()
        self.num_preemptions = 0
        self.step_count = 0
        self.seed = seed
        # speculative decoding: the per-step draft length (None: no speculation), and the slots past the
        # step's tokens a request that samples also gets (a draft model writes its proposals' KV there)
        self.draft_length_policy = draft_length_policy
        self.num_lookahead_slots = num_lookahead_slots
        self.spec_stats = SpecDecodeStats(draft_length_policy.max_k) if draft_length_policy is not None else None
        self.step_draft_len = 0
        self.step_budget = step_budget if scheduler_config.enable_chunked_prefill else None
        # KV transfer between engines (kv_transfer/): loads in flight, held prefills
        self.kv_transfer = KVTransferTracker(kv_connector, self.kv) if kv_connector is not None else None
        self.in_flight: dict[str, int] = {}  # request id -> scheduled steps not yet through update_from_output
        # beam search: searches in progress by user request id, beams waiting for their search's step (they
        # hold their blocks), and the searches done since the engine last took them
        self.beam_groups: dict[str, BeamGroup] = {}
        self.parked: dict[str, Request] = {}
        self.finished_beam_groups: list[BeamGroup] = []

    # ---- intake -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        p = request.sampling_params
        if p.use_beam_search:
            eos = None if p.ignore_eos else request.eos_token_id
            search = BeamSearch(p.n, p.max_tokens, p.length_penalty, eos)
            self.beam_groups[request.group_id] = BeamGroup(request, search)
        if request.status == RequestStatus.WAITING:
            self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            self.waiting.append(request)
            self.waiting.sort(key=lambda r: (r.priority, r.arrival_time))
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort or stop requests from outside (client gone, stop string). Frees their blocks now.
        The id of a beam search in progress (the user's request id) ends every live beam of it."""
        done = []
        for rid in request_ids:
            group = self.beam_groups.pop(rid, None)
            if group is not None:
                done += self.finish_requests([b.request_id for b in group.beams], status)
                continue
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_BEAMS:
                del self.parked[rid]
            elif req in self.waiting:
                self.waiting.remove(req)
            elif req in self.swapped:
                self.swapped.remove(req)
            req.status = status
            for child in req.forks_pending:
                if not child.is_finished:
                    child.status = status
                    self._free(child)
                    done.append(child)
            req.forks_pending = []
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        if self.kv_transfer is None or not self.kv_transfer.keep_blocks(req):
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if req.request_id in self.sent_to_worker:
            self.sent_to_worker.discard(req.request_id)
            self.finished_req_ids.append(req.request_id)

    def kv_cache_usage(self) -> float:
        return self.kv.pool.usage()

    def reset_prefix_cache(self) -> None:
        self.kv.pool.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or (self.kv_transfer is not None and self.kv_transfer.busy)

    # ---- the step -----------------------------------------------------------------------------
    def _lora_blocked(self, req: Request) -> bool:
        """Whether req's adapter would make more than max_loras adapters run at once."""
        if req.lora_request is None or self.max_loras is None:
            return False
        running = {r.lora_int_id for r in self.running if r.lora_request is not None}
        return req.lora_int_id not in running and len(running) >= self.max_loras

    def _victim(self) -> Optional[Request]:
        """The running request to preempt: the last admitted (fcfs) or the least urgent (priority); None when
        that one is in a step still in flight (the caller waits a step for it rather than preempting another:
        choosing among the rest would let a request re-admitted behind an in-flight one preempt it, and the two
        could preempt each other forever, losing their progress each time)."""
        if not self.running:
            return None
        if self.config.policy == "priority":
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        else:
            victim = self.running[-1]
        return None if victim.request_id in self.in_flight else victim

    def _preempt(self, victim: Request, scheduled: dict[str, int], swap_out: list) -> int:
        """Take a running request off the device; returns the budget it gave back."""
        self.running.remove(victim)
        returned = scheduled.pop(victim.request_id, 0)
        self.num_preemptions += 1
        victim.num_preemptions += 1
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(victim):
            swap_out.extend(self.kv.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            self.swapped.appendleft(victim)
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self._enqueue(victim, front=True)
        victim.spec_token_ids = []
        return returned

    def _fitting_chunk(self, req: Request, n: int, num_hit: int, hits) -> int:
        """The longest first chunk (< n tokens) of a waiting request whose blocks the pool has free now; 0: none."""
        start = req.num_computed_tokens + num_hit
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.blocks_needed(req, self._slots(req, mid, start), hits) <= self.kv.pool.num_free_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _release_waiting_holder(self, keep: Request) -> bool:
        """Free the blocks of a waiting request that holds some (a forked sibling or a continued beam not
        yet run) or else of a parked beam; it will recompute (cheaply, from the prefix cache).  Returns
        False when there is none."""
        for r in itertools.chain(reversed(self.waiting), reversed(self.parked.values())):
            if r is not keep and r.request_id in self.kv.req_blocks:
                self.kv.free(r)
                r.num_computed_tokens = 0
                r.num_preemptions += 1
                self.num_preemptions += 1
                return True
        return False

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Known tokens not yet computed (up to the budget), plus the drafts a decode verifies this step."""
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if n == 1 and req.spec_token_ids:
            n += self._num_drafts(req, budget - 1)
        return n

    def _num_drafts(self, req: Request, budget: int) -> int:
        """Drafts of a decoding request verified this step: within the step's draft length and budget,
        and no more than could still become output (max_tokens, max_model_len)."""
        p = req.sampling_params
        room = self.config.max_model_len - req.num_tokens
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return max(0, min(len(req.spec_token_ids), self.step_draft_len, budget, room))

    def _slots(self, req: Request, n: int, num_computed: Optional[int] = None) -> int:
        """Slots to allocate for n new tokens: a request that samples this step also gets the lookahead."""
        start = req.num_computed_tokens if num_computed is None else num_computed
        if self.num_lookahead_slots and start + n >= req.num_tokens:
            return n + self.num_lookahead_slots
        return n

    def _choose_draft_length(self) -> int:
        """The step's draft length from the policy, given the batch the running requests make."""
        if self.draft_length_policy is None:
            return 0
        budget = self.config.max_num_batched_tokens
        num_decodes, other_tokens = 0, 0
        for r in self.running:
            left = r.num_tokens - r.num_computed_tokens
            if left == 1:
                num_decodes += 1
            else:
                other_tokens += left
        return self.draft_length_policy.choose(num_decodes, min(other_tokens, max(budget - num_decodes, 0)))

    @staticmethod
    def _in_prefill(req: Request) -> bool:
        """More than one known token left to compute: its tokens come out of the step's prefill tokens."""
        return req.num_tokens - req.num_computed_tokens > 1

    def _plan_step(self, cap: int, max_requests: int) -> Optional[StepPlan]:
        """The step's token budget from the step-time estimate (core/step_budget.py): the decodes this step
        runs and the prompts that would get prefill tokens, oldest first (at most max_requests of them; a
        waiting one only while a seat is free: max_num_seqs); None (the cap alone): no budget, or no prompt
        to prefill."""
        if self.step_budget is None:
            return None
        decodes: list[tuple[int, int]] = []
        prefills: list[tuple[int, int]] = []

        def add(r: Request) -> None:  # a waiting beam or forked sibling with one token left is a decode too
            start, left = r.num_computed_tokens, r.num_tokens - r.num_computed_tokens
            if left == 1:
                decodes.append((start, 1 + min(len(r.spec_token_ids), self.step_draft_len)))
            elif left > 1:
                prefills.append((start, left))

        for r in self.running:
            if len(decodes) + len(prefills) >= max_requests:
                break
            if r.request_id not in self.in_flight:
                add(r)
        seats = self.config.max_num_seqs - len(self.running)  # free: for waiting (and swapped) requests
        queue = itertools.chain(self.swapped, self.waiting) if seats > 0 else iter(())
        queued = 0  # of the queue, taken into this step's prompts
        for r in queue:
            if sum(n for _, n in prefills) >= cap or len(decodes) + len(prefills) >= max_requests:
                break  # behind these nothing gets a token this step
            add(r)
            queued += 1
        if not prefills:
            return None
        # the batch being built (the default ITL target's reference): these prompts and the queue behind them
        # as far as seats are free, each a decode at its prompt's length once prefilled
        joining = [(start + left, 1) for start, left in prefills]
        for r in itertools.islice(itertools.chain(self.swapped, self.waiting), queued, max(seats, queued)):
            joining.append((r.num_tokens, 1))
        return self.step_budget.plan(decodes, prefills, cap, joining)

    def schedule(self, max_requests: Optional[int] = None) -> SchedulerOutput:
        """max_requests: at most this many requests in the step (batches in flight); None: no cap
        beyond max_num_seqs and the token budget."""
        cap = max_requests if max_requests is not None else self.config.max_num_seqs
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        order: list[Request] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted_any = False
        self.step_draft_len = self._choose_draft_length()
        if self.kv_transfer is not None:
            self.kv_transfer.expire_holds()
        # 0. the token budget; prompts' chunks come out of prefill_left, so the decodes' tokens stay reserved
        plan = self._plan_step(budget, cap)
        if plan is not None:
            budget = plan.budget
        prefill_left = plan.prefill_tokens if plan is not None else budget
        prefilled: dict[str, int] = {}  # request id -> its prefill tokens this step (given back if preempted)

        # 1. running requests, admission order
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < cap:
            req = self.running[i]
            prefill = self._in_prefill(req)
            n = 0 if req.request_id in self.in_flight else self._num_new_tokens(
                req, min(budget, prefill_left) if prefill else budget)
            if n <= 0:
                i += 1
                continue
            fits = True
            while self.kv.allocate_slots(req, self._slots(req, n)) is None:
                if self._release_waiting_holder(req):
                    continue
                victim = self._victim()
                if victim is None:  # the others are all in flight: req waits for a later step
                    fits = False
                    preempted_any = True  # the pool is short: admit nobody else this step either
                    break
                budget += self._preempt(victim, scheduled, swap_out)
                prefill_left += prefilled.pop(victim.request_id, 0)
                preempted_any = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; running[i] is now the next one
            if not fits:
                i += 1
                continue
            scheduled[req.request_id] = n
            order.append(req)
            budget -= n
            if prefill:
                prefilled[req.request_id] = n
                prefill_left -= n
            i = self.running.index(req) + 1  # a victim ahead of req (priority policy) shifts the list
        order = [r for r in order if r.request_id in scheduled]

        # 2. swapped requests come back first in line
        while (self.swapped and not preempted_any and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(scheduled) < cap):
            req = self.swapped[0]
            if self._lora_blocked(req):
                break
            prefill = self._in_prefill(req)
            n = self._num_new_tokens(req, min(budget, prefill_left) if prefill else budget)
            if n <= 0:
                break  # a prompt in prefill, and this step's prefill tokens are spent
            if self.kv.blocks_needed(req, self._slots(req, n)) > self.kv.pool.num_free_blocks:  # swapped incl.
                if self._release_waiting_holder(req):  # a forked sibling that never ran holds blocks: it yields
                    continue
                break
            pairs = self.kv.swap_in(req)
            assert pairs is not None
            swap_in.extend(pairs)
            self.swapped.popleft()
            if self.kv.allocate_slots(req, self._slots(req, n)) is None:  # cannot happen: checked above
                raise RuntimeError("swap-in accounting error")
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = n
            order.append(req)
            budget -= n
            prefill_left -= n if prefill else 0

        # 3. waiting requests (those whose structured-output grammar still compiles stay in line)
        # set aside, in order, and back at the front after: those whose grammar still compiles, and those under
        # an adapter that cannot run beside the running requests' adapters yet (max_loras)
        set_aside: list[Request] = []
        while (
            self.waiting
            and not preempted_any
            and not self.swapped
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < cap
        ):
            req = self.waiting[0]
            if (req.grammar is not None and req.grammar.pending) or self._lora_blocked(req):
                set_aside.append(self.waiting.pop(0))
                continue
            hits, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            if self.kv_transfer is not None and req.num_computed_tokens == 0:
                loading = self.kv_transfer.try_load(req, hits, num_hit)  # the rest of the prompt from elsewhere
                if loading is False:
                    break
                if loading:
                    self.waiting.pop(0)
                    continue
            remaining = req.num_tokens - req.num_computed_tokens - num_hit
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget if remaining == 1 else min(budget, prefill_left))
            if n <= 0:
                break  # this step's prefill tokens are spent: it stays first in line
            slots = self._slots(req, n, req.num_computed_tokens + num_hit)
            allocated = self.kv.allocate_slots(req, slots, hits)
            while allocated is None and self._release_waiting_holder(req):
                allocated = self.kv.allocate_slots(req, slots, hits)  # same lookup: count the query once
            if allocated is None and self.kv.grouped and self.config.enable_chunked_prefill and n > 1:
                # a hybrid layout's sliding groups hold a whole chunk's blocks while it runs: a shorter one fits
                n = self._fitting_chunk(req, n, num_hit, hits)
                if n > 0:
                    slots = self._slots(req, n, req.num_computed_tokens + num_hit)
                    allocated = self.kv.allocate_slots(req, slots, hits)
            if allocated is None:
                break
            self.waiting.pop(0)
            req.num_computed_tokens += num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = n
            order.append(req)
            budget -= n
            prefill_left -= n if remaining > 1 else 0
        self.waiting[:0] = set_aside

        return self._build_output(order, scheduled, swap_out, swap_in, plan)

    def _build_output(self, order, scheduled, swap_out, swap_in, plan: Optional[StepPlan] = None) -> SchedulerOutput:
        self.step_count += 1
        new_reqs = []
        items = []
        for req in order:
            n = scheduled[req.request_id]
            if req.request_id not in self.sent_to_worker:
                self.sent_to_worker.add(req.request_id)
                seed = req.sampling_params.seed
                # a non-negative 63-bit seed whatever the request's (signed 64-bit) seed and index
                gen_seed = ((seed + req.index) if seed is not None else hash((self.seed, req.request_id))) & SEED_MASK
                new_reqs.append(
                    NewRequestData(
                        req_id=req.request_id,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=list(req.output_token_ids),
                        sampling=sampling_spec(req),
                        generator_seed=gen_seed,
                        lora=req.lora_request,
                    )
                )
            start = req.num_computed_tokens
            known = min(n, req.num_tokens - start)
            drafts = req.spec_token_ids[: n - known]
            if self.kv_transfer is not None:
                self.kv_transfer.on_scheduled(req, start, n)
            groups = self.kv.get_group_block_ids(req.request_id) if self.kv.grouped else []  # built once a step
            items.append(
                ScheduledRequest(
                    req_id=req.request_id,
                    num_computed_tokens=start,
                    token_ids=req.all_token_ids[start : start + known] + drafts,
                    block_ids=groups[0] if groups else self.kv.get_block_ids(req.request_id),
                    sample=start + known == req.num_tokens,
                    num_draft_tokens=len(drafts),
                    group_block_ids=groups,
                    state_slot=self.kv.get_state_slot(req.request_id),
                )
            )
        finished, self.finished_req_ids = self.finished_req_ids, []
        for item in items:
            self.in_flight[item.req_id] = self.in_flight.get(item.req_id, 0) + 1
        return SchedulerOutput(
            step=self.step_count,
            new_requests=new_reqs,
            scheduled=items,
            finished_req_ids=finished,
            blocks_to_copy=self.kv.take_pending_copies(),
            blocks_to_swap_out=swap_out,
            blocks_to_swap_in=swap_in,
            num_tokens_to_propose=(self.draft_length_policy.num_to_propose(self.step_draft_len)
                                   if self.draft_length_policy is not None else 0),
            kv_connector_metadata=self.kv_transfer.build_meta() if self.kv_transfer is not None else None,
            token_budget=plan.budget if plan is not None else 0,
            target_step_s=plan.target_s if plan is not None else 0.0,
            draft_length=self.step_draft_len if self.draft_length_policy is not None else -1,
        )

    # ---- results ------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[tuple[Request, int]]:
        """Advance progress, append sampled tokens, apply token-level stop conditions.

        Returns (request, number of tokens appended) for requests that got tokens this step.
        """
        if self.kv_transfer is not None:
            resumed, failed = self.kv_transfer.process_output(result.kv_connector_output)
            for req in failed:
                self._free(req)
            for req in reversed(resumed):
                self._enqueue(req, front=True)
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        logprobs = dict(zip(result.req_ids, result.logprobs))
        drafts = dict(zip(result.req_ids, result.draft_token_ids))
        if out.num_tokens_to_propose and self.draft_length_policy is not None:
            self.draft_length_policy.observe_proposals(len(result.req_ids), sum(1 for d in result.draft_token_ids if d))
        touched: list[tuple[Request, int]] = []
        for item in out.scheduled:
            left = self.in_flight.pop(item.req_id, 1) - 1
            if left > 0:
                self.in_flight[item.req_id] = left
        for item in out.scheduled:
            req = self.requests.get(item.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            tokens = sampled.get(item.req_id)
            # KV is valid for the known tokens fed and the accepted drafts (all sampled tokens but the last)
            num_accepted = max(len(tokens) - 1, 0) if tokens and item.num_draft_tokens else 0
            req.num_computed_tokens += len(item.token_ids) - item.num_draft_tokens + num_accepted
            if item.num_draft_tokens and self.spec_stats is not None:
                self.spec_stats.observe(item.num_draft_tokens, num_accepted)
                self.draft_length_policy.observe(item.num_draft_tokens, num_accepted)
            req.spec_token_ids = (drafts.get(item.req_id) or []) if req.grammar is None else []
            if not tokens:
                continue
            if req.sampling_params.use_beam_search:
                self._beam_report(req, logprobs[item.req_id][0])
                continue
            appended = 0
            for tok in tokens:
                req.append_output_token(tok)
                appended += 1
                if self._check_stop(req, tok):
                    break
            if req.forks_pending:
                self._fork_children(req)
            touched.append((req, appended))
            if req.is_finished:
                self.running.remove(req)
                self._free(req)
            elif item.num_draft_tokens or self.num_lookahead_slots:
                self.kv.truncate(req, req.num_tokens)  # blocks holding only rejected drafts / lookahead
        return touched

    def _check_stop(self, req: Request, tok: int) -> bool:
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok == req.eos_token_id:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
                return True
            if tok in p.stop_token_ids:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                return True
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        if req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _fork_children(self, parent: Request) -> None:
        """n>1: siblings share the parent's prompt blocks and compute only the last prompt token."""
        num_shared = parent.num_prompt_tokens - 1
        for child in parent.forks_pending:
            if child.is_finished:
                continue
            if self.kv.can_fork:
                self.kv.fork(parent, child, num_shared)
                child.num_computed_tokens = num_shared
            # else (recurrent state: the parent's is past the shared prefix) the child computes its prompt
            child.num_cached_tokens = max(parent.num_cached_tokens, 0)
            child.status = RequestStatus.WAITING
            self._enqueue(child, front=True)
        parent.forks_pending = []

    # ---- beam search ----------------------------------------------------------------------------
    def _beam_report(self, beam: Request, lp: PositionLogprobs) -> None:
        """A beam sampled: park it with its top-2W next tokens; the search steps once every live beam has."""
        group = self.beam_groups[beam.group_id]
        self.running.remove(beam)
        beam.status = RequestStatus.WAITING_FOR_BEAMS
        self.parked[beam.request_id] = beam
        group.reports[beam.request_id] = list(zip(lp.token_ids[1:], lp.logprobs[1:]))  # [0] is the argmax
        group.num_scored += 1
        if len(group.reports) == len(group.beams):
            self._beam_step(group)

    def _beam_step(self, group: BeamGroup) -> None:
        """The search's step (core/beam_search.py) applied to the parked beams: a parent's first child is the
        parent itself with the new token, further children fork it, a parent without children ends."""
        moves = group.search.step([group.reports[b.request_id] for b in group.beams])
        group.reports = {}
        children: dict[int, list[int]] = {}  # parent index -> its children's places among the next beams
        for j, (parent, _) in enumerate(moves):
            children.setdefault(parent, []).append(j)
        next_beams: list[Optional[Request]] = [None] * len(moves)
        for i, beam in enumerate(group.beams):
            del self.parked[beam.request_id]
            mine = children.get(i)
            if not mine:  # its blocks go back, those shared with its forks stay with them
                beam.status = RequestStatus.FINISHED_STOPPED
                self._free(beam)
                continue
            for j in mine[1:]:  # forks first: they copy the parent's tokens before it grows
                next_beams[j] = self._fork_beam(group, beam, moves[j][1])
            beam.append_output_token(moves[mine[0]][1])
            beam.status = RequestStatus.WAITING
            self._enqueue(beam, front=True)
            next_beams[mine[0]] = beam
        group.beams = next_beams
        if group.search.done:
            del self.beam_groups[group.group_id]
            self.finished_beam_groups.append(group)

    def _fork_beam(self, group: BeamGroup, parent: Request, token: int) -> Request:
        """A new beam: parent's tokens plus token.  It shares the parent's blocks when the parent still
        holds the KV of all its tokens (a write into the shared partial last block copies it first, see
        KVCacheManager.allocate_slots), else it computes them anew."""
        rid = group.next_beam_id()
        while rid in self.requests:  # a user's request may carry such an id
            rid = group.next_beam_id()
        child = Request(rid, parent.prompt_token_ids, parent.sampling_params, parent.eos_token_id,
                        parent.arrival_time, parent.priority, parent.cache_salt, group_id=parent.group_id,
                        lora_request=parent.lora_request)
        child.output_token_ids = list(parent.output_token_ids)
        child.all_token_ids = list(parent.all_token_ids)
        if parent.num_computed_tokens == parent.num_tokens and self.kv.can_fork:
            self.kv.fork(parent, child, parent.num_tokens)
            child.num_computed_tokens = parent.num_tokens
        child.append_output_token(token)
        self.requests[child.request_id] = child
        self._enqueue(child, front=True)
        return child

    def take_finished_beam_groups(self) -> list[BeamGroup]:
        """The beam searches done since the last call (their beams are freed; results in group.search)."""
        done, self.finished_beam_groups = self.finished_beam_groups, []
        return done

    def get_stats(self) -> SchedulerStats:
        pool = self.kv.pool
        # beams past their search's first step run, whether parked or queued for their next token
        beams = len(self.parked) + sum(1 for r in self.waiting
                                       if r.sampling_params.use_beam_search and r.output_token_ids)
        return SchedulerStats(
            num_running=len(self.running) + beams,
            num_waiting=len(self.waiting) + len(self.parked) - beams
            + (len(self.kv_transfer.loading) if self.kv_transfer else 0) + sum(
                1 for r in self.requests.values() if r.status == RequestStatus.WAITING_FOR_FORK
            ),
            num_swapped=len(self.swapped),
            kv_cache_usage=pool.usage(),
            num_total_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode=self.spec_stats,
        )
