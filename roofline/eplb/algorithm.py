"""Expert placement for EPLB: per-expert loads -> which logical expert each physical slot holds.

Written from the description of DeepSeek's hierarchical load balancer:

1. expert groups to nodes: the `num_groups` groups of consecutive experts (the router's groups) are
   packed onto the nodes, an equal number per node, heaviest group first onto the lightest node that
   still has room (balanced packing);
2. redundant replicas: inside each node its experts get `physical_per_node` slots; every slot beyond
   one per expert goes, one at a time, to the expert whose load per replica is highest;
3. physical experts to ranks: each node's replicas (weight: their expert's load / its replica count)
   are packed onto the node's ranks with the same balanced packing, an equal number per rank.

When the groups do not divide over the nodes, the whole world is one node of one group (the global
policy).  Physical slots are numbered rank-major: rank r holds slots [r * per_rank, (r + 1) * per_rank).
Pure Python/torch on the CPU; the same inputs give the same placement on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """physical_to_logical[p]: the logical expert slot p holds; per_rank slots per rank."""

    physical_to_logical: tuple[int, ...]
    num_logical: int
    num_ranks: int

    @property
    def num_physical(self) -> int:
        return len(self.physical_to_logical)

    @property
    def per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def replicas(self, expert: int) -> list[int]:
        """The physical slots holding `expert`, in slot order."""
        return [p for p, e in enumerate(self.physical_to_logical) if e == expert]

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts of rank's slots, in slot order."""
        return self.physical_to_logical[rank * self.per_rank:(rank + 1) * self.per_rank]

    def rank_loads(self, loads) -> list[float]:
        """Expected tokens per rank when every expert's load splits evenly over its replicas."""
        loads = [float(x) for x in loads]
        count = [0] * self.num_logical
        for e in self.physical_to_logical:
            count[e] += 1
        out = [0.0] * self.num_ranks
        for p, e in enumerate(self.physical_to_logical):
            out[p // self.per_rank] += loads[e] / count[e]
        return out


def balancedness(rank_loads: list[float]) -> float:
    """mean / max tokens per rank (1.0: perfectly balanced; 1.0 when nothing ran)."""
    peak = max(rank_loads) if rank_loads else 0.0
    return 1.0 if peak <= 0 else (sum(rank_loads) / len(rank_loads)) / peak


def balanced_packing(weights: list[float], num_packs: int) -> list[int]:
    """Items into num_packs packs of exactly len(weights) / num_packs items each: heaviest item first,
    each onto the lightest pack that still has room (ties: lower pack).  Returns each item's pack."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    load = [0.0] * num_packs
    size = [0] * num_packs
    pack_of = [0] * n
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        best = min((p for p in range(num_packs) if size[p] < per_pack), key=lambda p: (load[p], p))
        pack_of[i] = best
        load[best] += weights[i]
        size[best] += 1
    return pack_of


def replicate(loads: list[float], num_slots: int) -> list[int]:
    """Replica count per expert over num_slots >= len(loads) slots: one each, then every extra slot to
    the expert with the highest load per replica (ties: lower expert)."""
    if num_slots < len(loads):
        raise ValueError(f"{num_slots} slots cannot hold {len(loads)} experts")
    count = [1] * len(loads)
    for _ in range(num_slots - len(loads)):
        hot = max(range(len(loads)), key=lambda e: (loads[e] / count[e], -e))
        count[hot] += 1
    return count


def _replicate_and_pack(loads: list[float], num_slots: int, num_ranks: int) -> tuple[list[int], list[int]]:
    """Replicas (expert indices into loads) filling num_slots, and each replica's rank.  The greedy
    replication (replicate) can overshoot what the ranks can balance: two hot experts with three replicas
    each spread 2, 2, 1, 1 over four ranks, where two replicas each would spread evenly.  So every prefix of
    the greedy's extra slots is tried, the slots left over holding replicas of the coldest experts, and the
    packing with the lowest peak rank load wins (ties: the longer prefix).  The full greedy is among the
    candidates, so the peak never exceeds the greedy's."""
    n = len(loads)
    extra = num_slots - n
    order = []  # the greedy's extra slots, in the order it hands them out
    count = [1] * n
    for _ in range(extra):
        hot = max(range(n), key=lambda e: (loads[e] / count[e], -e))
        count[hot] += 1
        order.append(hot)
    coldest = sorted(range(n), key=lambda e: (loads[e], e))
    best = None
    for k in range(extra + 1):
        c = [1] * n
        for e in order[:k]:
            c[e] += 1
        for i in range(extra - k):  # leftover slots: replicas of the coldest experts (they add no load)
            c[coldest[i % n]] += 1
        replicas = [e for e in range(n) for _ in range(c[e])]
        shares = [loads[e] / c[e] for e in replicas]
        rank_of = balanced_packing(shares, num_ranks)
        peak = max(sum(s for s, r in zip(shares, rank_of) if r == rr) for rr in range(num_ranks))
        if best is None or peak <= best[0] * (1 + 1e-12):
            best = (peak, replicas, rank_of)
    return best[1], best[2]


def rebalance(loads, num_ranks: int, num_redundant: int = 0, num_groups: int = 1, num_nodes: int = 1) -> Placement:
    """The placement of len(loads) logical experts (+ num_redundant replicas) over num_ranks ranks."""
    loads = [float(x) for x in (loads.tolist() if isinstance(loads, torch.Tensor) else loads)]
    num_logical = len(loads)
    num_physical = num_logical + num_redundant
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    if num_physical % num_ranks:
        raise ValueError(f"{num_logical} experts + {num_redundant} redundant do not split evenly over "
                         f"{num_ranks} expert-parallel ranks")
    hierarchical = (num_groups >= 1 and num_nodes >= 1 and num_logical % num_groups == 0
                    and num_groups % num_nodes == 0 and num_ranks % num_nodes == 0
                    and (num_physical // num_nodes) >= num_logical // num_nodes)
    if not hierarchical:
        num_groups, num_nodes = 1, 1
    per_group = num_logical // num_groups
    ranks_per_node = num_ranks // num_nodes
    physical_per_node = num_physical // num_nodes
    # 1. groups to nodes
    group_loads = [sum(loads[g * per_group:(g + 1) * per_group]) for g in range(num_groups)]
    node_of_group = balanced_packing(group_loads, num_nodes)
    slots: list[int] = [0] * num_physical
    for node in range(num_nodes):
        experts = [e for g in range(num_groups) if node_of_group[g] == node
                   for e in range(g * per_group, (g + 1) * per_group)]
        # 2. replicas inside the node, 3. replicas to the node's ranks
        replicas, rank_of = _replicate_and_pack([loads[e] for e in experts], physical_per_node, ranks_per_node)
        replicas = [experts[i] for i in replicas]
        per_rank = physical_per_node // ranks_per_node
        for r in range(ranks_per_node):
            mine = sorted(e for e, rr in zip(replicas, rank_of) if rr == r)
            base = (node * ranks_per_node + r) * per_rank
            slots[base:base + per_rank] = mine
    return Placement(tuple(slots), num_logical, num_ranks)


def initial_placement(num_logical: int, num_ranks: int, num_redundant: int = 0) -> Placement:
    """Before any load is known: experts in order over the ranks (rank r holds a contiguous run), the
    redundant slots replicating experts 0, 1, ... (as a rebalance of equal loads would spread them)."""
    num_physical = num_logical + num_redundant
    if num_physical % num_ranks:
        raise ValueError(f"{num_logical} experts + {num_redundant} redundant do not split evenly over "
                         f"{num_ranks} expert-parallel ranks")
    if num_redundant == 0:
        return Placement(tuple(range(num_logical)), num_logical, num_ranks)
    return rebalance([1.0] * num_logical, num_ranks, num_redundant)
