"""EPLB while serving: per layer, per expert token counts over a sliding window of steps, a rebalance
every `step_interval` steps, and the expert weights moved between ranks to the new placement.

Every rank of the EP group runs the same steps (the model's collectives keep them in lock step), so
`EplbState.step()` is called on each after each forward step; the counts are each rank's own share of
the tokens (FusedMoE.expert_load) and are summed over the group at rebalance time, so every rank
computes the same placement (algorithm.rebalance).  `move_experts` then sends each rank the weights
of the experts it newly holds in ONE all_to_all_single per layer, from the lowest-numbered rank that
holds them now; experts a rank keeps are copied locally.  Replicas hold identical weights, so the
model's function does not change -- only where its experts run.

Balancedness (mean / max tokens per rank, per layer) is taken from the window at each rebalance, under
the placement before and the one after (the replicas of an expert sharing its tokens evenly).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from roofline.config import EPLBConfig
from roofline.distributed.parallel_state import GroupCoordinator
from roofline.eplb.algorithm import Placement, balancedness, rebalance
from roofline.model_executor.layers.moe.layer import FusedMoE

logger = logging.getLogger(__name__)


def move_experts(layer: FusedMoE, new: Placement, group: GroupCoordinator) -> int:
    """Give `layer` the placement `new`, exchanging expert weights over `group`; returns how many
    experts this rank received."""
    old = layer.expert_map.placement
    me, per_rank = group.rank_in_group, new.per_rank
    old_local = {e: s for s, e in reversed(list(enumerate(old.rank_slots(me))))}  # expert -> first local slot

    def incoming(rank: int) -> list[tuple[int, int]]:
        """(source rank, expert) for each expert `rank` newly holds, in its new slot order."""
        held, out = set(old.rank_slots(rank)), []
        for e in new.rank_slots(rank):
            if e not in held and all(e != x for _, x in out):
                out.append((old.replicas(e)[0] // per_rank, e))
        return out

    stacks = layer.expert_stacks()  # dense stacks, or FP8 bytes and scales: each slot-major
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(stacks):
        by_dtype.setdefault(t.dtype, []).append(i)
    plans = [incoming(r) for r in range(group.world_size)]
    send = [e for r in range(group.world_size) for src, e in plans[r] if src == me]
    in_splits = [sum(1 for src, _ in plans[r] if src == me) for r in range(group.world_size)]
    out_splits = [sum(1 for src, _ in plans[me] if src == r) for r in range(group.world_size)]
    # what arrives is grouped by source rank, each source's experts in this rank's slot order
    order = sorted(range(len(plans[me])), key=lambda i: plans[me][i][0])
    got: dict[int, dict[int, torch.Tensor]] = {plans[me][i][1]: {} for i in order}
    for idxs in by_dtype.values():  # one exchange per dtype: each expert's tensors of it in one row
        sizes = [stacks[i][0].numel() for i in idxs]
        rows = (torch.stack([torch.cat([stacks[i][old_local[e]].reshape(-1) for i in idxs]) for e in send])
                if send else stacks[idxs[0]].new_empty(0, sum(sizes)))
        received = group.all_to_all_single(rows, in_splits, out_splits)
        for j, i in enumerate(order):
            for i_stack, part in zip(idxs, received[j].split(sizes)):
                got[plans[me][i][1]][i_stack] = part
    new_stacks = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in stacks]
    for slot, e in enumerate(new.rank_slots(me)):
        for i, t in enumerate(stacks):
            if e in old_local:
                new_stacks[i][slot].copy_(t[old_local[e]])
            else:
                new_stacks[i][slot].copy_(got[e][i].view(t[0].shape))
    layer.set_expert_stacks(new_stacks)
    layer.expert_map.set(new)
    return len(got)


class EplbState:
    def __init__(self, model: torch.nn.Module, cfg: EPLBConfig, group: GroupCoordinator, num_nodes: int = 1):
        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.expert_map is not None]
        if not self.layers:
            raise ValueError("enable_eplb: the model has no expert-parallel MoE layers "
                             "(a MoE model and enable_expert_parallel over more than one rank are needed)")
        self.cfg, self.group, self.num_nodes = cfg, group, num_nodes
        num_experts = self.layers[0].num_experts
        for m in self.layers:
            m.expert_load = torch.zeros(num_experts, dtype=torch.int64, device=m.device)
        self.window = torch.zeros(cfg.window_size, len(self.layers), num_experts, dtype=torch.int64)
        self.steps = 0
        self.rebalances = 0
        self.balancedness: list[float] = []  # per layer, after the last rebalance
        self.balancedness_before: list[float] = []  # per layer, the window under the placement it replaced

    def step(self) -> None:
        """After a forward step: this step's counts into the window; a rebalance every step_interval steps."""
        self.window[self.steps % self.cfg.window_size] = torch.stack([m.expert_load.cpu() for m in self.layers])
        for m in self.layers:
            m.expert_load.zero_()
        self.steps += 1
        if self.steps % self.cfg.step_interval == 0:
            self.rebalance()

    def window_loads(self) -> torch.Tensor:
        """[layers, experts] tokens over the window, summed over the EP group (a collective)."""
        return self.group.all_reduce(self.window.sum(dim=0))

    def rebalance(self, loads: Optional[torch.Tensor] = None) -> None:
        """New placements from the window's loads (or `loads`), weights moved; every rank calls this."""
        loads = self.window_loads() if loads is None else loads
        before, after, moved = [], [], 0
        for i, m in enumerate(self.layers):
            layer_loads = loads[i].tolist()
            new = rebalance(layer_loads, self.group.world_size, m.expert_map.placement.num_physical - m.num_experts,
                            m.routing.num_groups, self.num_nodes)
            before.append(balancedness(m.expert_map.placement.rank_loads(layer_loads)))
            after.append(balancedness(new.rank_loads(layer_loads)))
            moved += move_experts(m, new, self.group)
        self.balancedness_before, self.balancedness = before, after
        self.rebalances += 1
        if self.cfg.log_balancedness:
            logger.info("EPLB rebalance %d at step %d: balancedness %.3f -> %.3f (mean over %d layers); "
                        "%d experts received here", self.rebalances, self.steps, sum(before) / len(before),
                        sum(after) / len(after), len(before), moved)
