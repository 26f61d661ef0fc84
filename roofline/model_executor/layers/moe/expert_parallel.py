"""Expert parallelism for a MoE layer: which rank holds which expert, and moving tokens to them and back.

Under expert parallelism the EP group (DP x TP ranks, distributed/layout.py) holds every layer's
physical experts -- the logical experts plus EPLB's redundant replicas -- whole, `per_rank` slots per
rank, rank-major (`ExpertMap`).  A token's chosen logical expert becomes one of its replicas
(`ExpertMap.choose`: replicas taken in turn by token position) and so an owning rank and a local slot.

Each rank sends the tokens *it* is responsible for (its TP rank's share of its DP rank's batch) and
gets their expert outputs back, by one of two exchanges (--all2all-backend):

    all_to_all                 dispatch: every (token, expert) pair's hidden row to the owner's rank
                               (all_to_all_single, counts exchanged first); the owner runs its local
                               experts on what it received; combine: the outputs travel back the
                               same way, are weighted at home and summed per token
    allgather_reducescatter    every rank all-gathers every rank's tokens and routing, computes its
                               own experts' weighted part for all of them, and a reduce-scatter
                               returns each rank the sums for its own tokens

Both give every token the sum over its k experts of weight * expert(x), as the single-rank layer does.

Dual-batch overlap (--enable-dbo, `dual_batch_step`): a step with enough tokens runs every MoE layer's
all_to_all exchange as two micro-batches (the first and second half of this rank's tokens) whose
collectives are issued without waiting: the second half's dispatch is in flight while the first half's
experts compute, and the first half's combine while the second's do (exchange_all_to_all_dual).  Every rank of
the EP group decides the same way (from the whole step's token count, all DP ranks' parts included) and
issues the same collectives in the same order, a rank with an empty half (or no tokens: an idle DP rank's
join_expert_exchanges) too.  `EXCHANGE_WAIT_S` accumulates the time this rank spent blocked on its exchanges
(the part of the all-to-all that no compute hid), for benchmarks.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from roofline.distributed.parallel_state import GroupCoordinator
from roofline.eplb.algorithm import Placement

# rows [M, H], local slots [M], weights [M] or None (unweighted) -> expert outputs [M, H]
LocalExperts = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class ExpertMap:
    """A layer's placement as tensors: replica table, this rank's slots."""

    def __init__(self, placement: Placement, ep_rank: int) -> None:
        self.ep_rank = ep_rank
        self.set(placement)

    def set(self, placement: Placement) -> None:
        self.placement = placement
        self.per_rank = placement.per_rank
        e = placement.num_logical
        # on the CPU whatever the default device (a meta-device build included); choose() moves them
        reps = [placement.replicas(expert) for expert in range(e)]
        self.replica_count = torch.tensor([len(r) for r in reps], dtype=torch.int64, device="cpu")
        width = max(len(r) for r in reps)
        table = torch.tensor([r + [-1] * (width - len(r)) for r in reps], dtype=torch.int64, device="cpu")
        self.replica_table = table
        self.local_logical = placement.rank_slots(self.ep_rank)  # logical expert of each local slot

    def choose(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Logical ids [N, k] -> physical ids [N, k]: replicas in turn by token position (+ offset)."""
        if self.replica_table.device != ids.device:
            self.replica_table = self.replica_table.to(ids.device)
            self.replica_count = self.replica_count.to(ids.device)
        if self.replica_table.shape[1] == 1:
            return self.replica_table[ids, 0]
        n, k = ids.shape
        turn = (torch.arange(n, dtype=torch.int64, device=ids.device).unsqueeze(1)
                + torch.arange(k, dtype=torch.int64, device=ids.device) + offset)
        return self.replica_table[ids, turn % self.replica_count[ids]]


def exchange_all_to_all(x: torch.Tensor, weights: torch.Tensor, physical: torch.Tensor, per_rank: int,
                        group: GroupCoordinator, local_experts: LocalExperts) -> torch.Tensor:
    """x [n, H], weights/physical [n, k] (this rank's tokens) -> [n, H] via all_to_all_single."""
    n, k = physical.shape
    flat = physical.reshape(-1)
    dest = flat // per_rank
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=group.world_size)
    t = time.perf_counter()
    recv_counts = group.all_to_all_single(send_counts, [1] * group.world_size, [1] * group.world_size)
    in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
    tokens = order // k
    recv_slots = group.all_to_all_single(flat[order] % per_rank, in_splits, out_splits)
    recv_x = group.all_to_all_single(x.index_select(0, tokens), in_splits, out_splits)
    EXCHANGE_WAIT_S[0] += time.perf_counter() - t
    y = local_experts(recv_x, recv_slots, None)
    t = time.perf_counter()
    back = group.all_to_all_single(y, out_splits, in_splits)
    EXCHANGE_WAIT_S[0] += time.perf_counter() - t
    back = back * weights.reshape(-1).index_select(0, order).to(x.dtype)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, back)


def exchange_allgather_reducescatter(x: torch.Tensor, weights: torch.Tensor, physical: torch.Tensor,
                                     per_rank: int, group: GroupCoordinator,
                                     local_experts: LocalExperts) -> torch.Tensor:
    """As exchange_all_to_all, by all-gather of every rank's tokens and a reduce-scatter of the sums."""
    n, k = physical.shape
    sizes = group.all_gather(physical.new_tensor([n]), dim=0).tolist()
    width = max(sizes)
    pad = width - n
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        weights = torch.cat([weights, weights.new_zeros(pad, k)])
        physical = torch.cat([physical, physical.new_full((pad, k), -1)])
    all_x = group.all_gather(x, dim=0)
    all_w = group.all_gather(weights.contiguous(), dim=0).reshape(-1)
    all_p = group.all_gather(physical.contiguous(), dim=0).reshape(-1)
    mine = torch.nonzero((all_p >= 0) & (all_p // per_rank == group.rank_in_group)).squeeze(1)
    tokens = mine // k
    sums = torch.zeros_like(all_x)
    if mine.numel():
        sums.index_add_(0, tokens, local_experts(all_x.index_select(0, tokens), all_p[mine] % per_rank, all_w[mine]))
    return group.reduce_scatter(sums)[:n]


EXCHANGES = {"all_to_all": exchange_all_to_all, "allgather_reducescatter": exchange_allgather_reducescatter}

_dual_batch = False  # this step's exchanges as two overlapped micro-batches (set by the worker, every step)
EXCHANGE_WAIT_S = [0.0]  # seconds this rank spent blocked in the exchanges' collectives (profiling)


def dual_batch_step(on: bool) -> None:
    """Whether this step's all_to_all exchanges run as two overlapped micro-batches (every EP rank the same)."""
    global _dual_batch
    _dual_batch = bool(on)


def dual_batch() -> bool:
    return _dual_batch


def _timed_wait(work) -> None:
    t = time.perf_counter()
    work.wait()
    EXCHANGE_WAIT_S[0] += time.perf_counter() - t


def exchange_all_to_all_dual(x: torch.Tensor, weights: torch.Tensor, physical: torch.Tensor, per_rank: int,
                             group: GroupCoordinator, local_experts: LocalExperts) -> torch.Tensor:
    """exchange_all_to_all as two micro-batches (this rank's first and second half of its tokens), their
    dispatches and combines asynchronous: the same function, the communication hidden behind the other half's
    expert compute."""
    n, k = physical.shape
    w = group.world_size
    halves = [(0, n // 2), (n // 2, n)]
    plans = []
    for lo, hi in halves:  # each half's routing, its rows sorted by destination rank
        flat = physical[lo:hi].reshape(-1)
        dest = flat // per_rank
        order = torch.argsort(dest, stable=True)
        plans.append((lo, hi, flat, order, torch.bincount(dest, minlength=w)))
    t = time.perf_counter()
    recv = group.all_to_all_single(torch.stack([p[4] for p in plans], dim=1).reshape(-1), [2] * w, [2] * w)
    EXCHANGE_WAIT_S[0] += time.perf_counter() - t
    recv = recv.view(w, 2)
    dispatched = []
    for h, (lo, _, flat, order, send_counts) in enumerate(plans):  # both dispatches in flight
        in_splits, out_splits = send_counts.tolist(), recv[:, h].tolist()
        slots = group.all_to_all_single_async(flat[order] % per_rank, in_splits, out_splits)
        rows = group.all_to_all_single_async(x.index_select(0, lo + order // k), in_splits, out_splits)
        dispatched.append((in_splits, out_splits, slots, rows))
    combined = []
    for in_splits, out_splits, (slots, slots_work), (rows, rows_work) in dispatched:
        _timed_wait(slots_work)
        _timed_wait(rows_work)
        y = local_experts(rows, slots, None)  # the other half's collectives travel meanwhile
        combined.append(group.all_to_all_single_async(y, out_splits, in_splits))
    out = torch.zeros_like(x)
    for (lo, hi, _, order, _), (back, work) in zip(plans, combined):
        _timed_wait(work)
        back = back * weights[lo:hi].reshape(-1).index_select(0, order).to(x.dtype)[:, None]
        out.index_add_(0, lo + order // k, back)
    return out
