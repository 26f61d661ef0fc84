"""The tensor-parallel group a process belongs to, and the collectives layers call.

With no group initialized (single device) every collective is the identity, so model code reads
the same at tp=1 and tp=N.  `init_tensor_parallel` joins a torch.distributed process group
(gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Optional[object] = None  # torch.distributed ProcessGroup
    all_reduce_count: int = 0  # collectives issued, for tests and accounting
    all_gather_count: int = 0


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.world_size


def set_tp_group(rank: int, world_size: int, group=None) -> None:
    global _TP
    _TP = TPGroup(rank=rank, world_size=world_size, group=group)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.world_size == 1:
        return x
    _TP.all_reduce_count += 1
    dist.all_reduce(x, group=_TP.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's shard along dim (rank order)."""
    if _TP.world_size == 1:
        return x
    _TP.all_gather_count += 1
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)
