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
"""

from __future__ import annotations

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
    recv_counts = group.all_to_all_single(send_counts, [1] * group.world_size, [1] * group.world_size)
    in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
    tokens = order // k
    recv_slots = group.all_to_all_single(flat[order] % per_rank, in_splits, out_splits)
    recv_x = group.all_to_all_single(x.index_select(0, tokens), in_splits, out_splits)
    y = local_experts(recv_x, recv_slots, None)
    back = group.all_to_all_single(y, out_splits, in_splits)
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
