"""The tensor-parallel group a process belongs to, and the collectives layers call.

With no group initialized (single device) every collective is the identity, so model code reads
the same at tp=1 and tp=N.  `init_distributed` joins a torch.distributed process group (gloo on
CPU, NCCL on CUDA) for the model's collectives, plus a CPU (gloo) *control* group that carries the
engine's messages from rank 0 to the other ranks (see roofline.distributed.comm).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The control group waits for the next engine message for as long as the engine stays idle, so its
# timeout is effectively infinite; a peer that dies still breaks the wait at once (closed socket).
CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Optional[object] = None  # torch.distributed ProcessGroup
    all_reduce_count: int = 0  # collectives issued, for tests and accounting
    all_gather_count: int = 0


_TP = TPGroup()
_CONTROL_GROUP: Optional[object] = None


def get_tp_group() -> TPGroup:
    return _TP


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.world_size


def set_tp_group(rank: int, world_size: int, group=None) -> None:
    global _TP
    _TP = TPGroup(rank=rank, world_size=world_size, group=group)


@contextlib.contextmanager
def tp_group_as(rank: int, world_size: int):
    """Build layers as `rank` of a world of `world_size` without joining one (shape checks)."""
    global _TP
    saved = _TP
    _TP = TPGroup(rank=rank, world_size=world_size, group=None)
    try:
        yield
    finally:
        _TP = saved


def get_control_group():
    if _CONTROL_GROUP is None:
        raise RuntimeError("torch.distributed is not initialized in this process (init_distributed)")
    return _CONTROL_GROUP


def collective_counts() -> tuple[int, int]:
    """(all-reduces, all-gathers) issued by the model in this process since the last reset."""
    return _TP.all_reduce_count, _TP.all_gather_count


def reset_collective_counts() -> None:
    _TP.all_reduce_count = 0
    _TP.all_gather_count = 0


def init_distributed(rank: int, world_size: int, init_method: str, backend: str = "gloo",
                     timeout_s: float = 600.0) -> None:
    """Join the world (torchrun-style TCP rendezvous at init_method, e.g. tcp://10.0.0.1:29500).

    The whole world is one tensor-parallel group: model collectives run on it with `backend`;
    a separate gloo group carries control messages (CPU bytes, also under NCCL).
    """
    global _CONTROL_GROUP
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed_backend must be 'gloo' or 'nccl', got {backend!r}")
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    set_tp_group(rank, world_size, dist.group.WORLD)
    logger.debug("rank %d/%d joined %s (%s)", rank, world_size, init_method, backend)


def destroy_distributed() -> None:
    global _CONTROL_GROUP
    set_tp_group(0, 1, None)
    _CONTROL_GROUP = None
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken world (dead peer) may fail to tear down cleanly
            logger.debug("destroy_process_group failed", exc_info=True)


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
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x, group=_TP.group)
    return torch.cat(parts, dim=dim)
