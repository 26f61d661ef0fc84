"""The rank layout of a distributed world: which ranks form each TP, PP, DP and EP group (plus how the
MoE layers use their EP group: redundant expert slots, token exchange).

    world = DP x PP x TP, ranks numbered with TP innermost:  rank = (dp * PP + pp) * TP + tp

    TP group   same (dp, pp), every tp        consecutive ranks: one layer split over them
    PP group   same (dp, tp), every pp        the stages of one pipeline, first stage first
    DP group   same (pp, tp), every dp        the replicas of one shard (each with its own requests)
    EP group   same pp, every (dp, tp)        the ranks the MoE layers' experts are spread over
                                              (dp-major order); size 1 (each rank alone) without
                                              expert parallelism

Pure arithmetic (no torch.distributed): parallel_state builds the process groups from it, the
launcher and the planner size worlds with it, tests check it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RankCoords:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    num_redundant_experts: int = 0  # extra physical expert slots per MoE layer (EPLB)
    all2all_backend: str = "all_to_all"  # how the EP group exchanges tokens (config.ALL2ALL_BACKENDS)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            if getattr(self, name) < 1:
                field = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size",
                         "dp": "data_parallel_size"}[name]
                raise ValueError(f"{field} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, pc) -> "ParallelLayout":
        """From a ParallelConfig (tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
        enable_expert_parallel)."""
        return cls(tp=pc.tensor_parallel_size, pp=pc.pipeline_parallel_size, dp=pc.data_parallel_size,
                   expert_parallel=pc.enable_expert_parallel,
                   num_redundant_experts=pc.eplb.num_redundant_experts if pc.enable_eplb else 0,
                   all2all_backend=pc.all2all_backend)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def ep(self) -> int:
        """Ranks the experts are spread over: DP x TP with expert parallelism, else 1."""
        return self.dp * self.tp if self.expert_parallel else 1

    # ---- one rank ------------------------------------------------------------------------------
    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def coords(self, rank: int) -> RankCoords:
        self._check(rank)
        return RankCoords(dp=rank // (self.pp * self.tp), pp=(rank // self.tp) % self.pp, tp=rank % self.tp)

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0) -> int:
        if not (0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp):
            raise ValueError(f"coordinates dp={dp}, pp={pp}, tp={tp} outside the layout dp={self.dp}, "
                             f"pp={self.pp}, tp={self.tp}")
        return (dp * self.pp + pp) * self.tp + tp

    # ---- groups: every group of a kind, each as its ranks in group order --------------------------
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, p, t) for t in range(self.tp)] for d in range(self.dp) for p in range(self.pp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, p, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, p, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def ep_groups(self) -> list[list[int]]:
        if not self.expert_parallel:
            return [[r] for r in range(self.world_size)]
        return [[self.rank_of(d, p, t) for d in range(self.dp) for t in range(self.tp)] for p in range(self.pp)]

    def groups(self, kind: str) -> list[list[int]]:
        try:
            return {"tp": self.tp_groups, "pp": self.pp_groups, "dp": self.dp_groups, "ep": self.ep_groups}[kind]()
        except KeyError:
            raise ValueError(f"unknown group kind {kind!r} (tp, pp, dp, ep)") from None

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group of this kind."""
        self._check(rank)
        return next(g for g in self.groups(kind) if rank in g)

    # ---- pipeline neighbours ---------------------------------------------------------------------
    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank).pp == self.pp - 1

    def next_stage_rank(self, rank: int) -> int:
        """The rank of the next pipeline stage (same dp, tp), wrapping from the last stage to the first."""
        c = self.coords(rank)
        return self.rank_of(c.dp, (c.pp + 1) % self.pp, c.tp)

    def prev_stage_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return self.rank_of(c.dp, (c.pp - 1) % self.pp, c.tp)

    def describe(self) -> str:
        ep = f", EP={self.ep}" if self.expert_parallel else ""
        return f"DP={self.dp} x PP={self.pp} x TP={self.tp} ({self.world_size} ranks{ep})"


# ---- pipeline stages: which layers each holds ---------------------------------------------------
def stage_layer_ranges(num_layers: int, pp: int, partition: Optional[list[int]] = None) -> list[tuple[int, int]]:
    """[start, end) of every stage's layers."""
    if partition is None:
        if num_layers < pp:
            raise ValueError(f"pipeline_parallel_size={pp} needs at least {pp} layers, the model has {num_layers}")
        counts = [num_layers // pp] * pp
        for i in range(num_layers % pp):  # extras to the stages before the last (it holds the LM head)
            counts[(pp - 2 - i) % pp] += 1
    else:
        counts = list(partition)
        if len(counts) != pp or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition {','.join(map(str, counts))} must give {pp} stages "
                             f"{num_layers} layers in all (the model's num_hidden_layers)")
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out
