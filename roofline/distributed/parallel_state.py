"""The tensor-parallel group a process belongs to, and the collectives layers call.

With no group initialized (single device) every collective is the identity, so model code reads
the same at tp=1 and tp=N.  `init_distributed` joins a torch.distributed process group (gloo on
CPU, NCCL on CUDA) for the model's collectives, plus a CPU (gloo) *control* group that carries the
engine's messages from rank 0 to the other ranks (see roofline.distributed.comm).
"""

from __future__ import annotations

import contextlib
import logging
import socket
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
_STORE_SOCKET: Optional[socket.socket] = None  # rank 0's listening socket for the rendezvous store


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


def _store_listener(host: str, port: int) -> socket.socket:
    """A socket listening on host:port only (torch's own TCPStore server would listen on every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def rendezvous_store(rank: int, world_size: int, host: str, port: int, secret: str, timeout_s: float):
    """The world's key-value store: rank 0 serves it on host:port alone, every rank's keys live under a
    prefix derived from the launch's shared secret, so a process that does not know the secret can
    neither join the world nor read or overwrite its keys."""
    global _STORE_SOCKET
    if not secret:
        raise ValueError("joining a distributed world needs its shared secret (ROOFLINE_DIST_SECRET)")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        _STORE_SOCKET = _store_listener(host, port)
        store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=_STORE_SOCKET.fileno())
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    return dist.PrefixStore(f"roofline-{secret}/", store)


def init_distributed(rank: int, world_size: int, host: str, port: int, secret: str, backend: str = "gloo",
                     timeout_s: float = 600.0) -> None:
    """Join the world: rendezvous through rank 0's store at host:port (rendezvous_store), then one
    process group for the model's collectives with `backend`, plus a gloo group for control messages
    (CPU bytes, also under NCCL).  The whole world is one tensor-parallel group."""
    global _CONTROL_GROUP
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed_backend must be 'gloo' or 'nccl', got {backend!r}")
    store = rendezvous_store(rank, world_size, host, port, secret, timeout_s)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    set_tp_group(rank, world_size, dist.group.WORLD)
    logger.debug("rank %d/%d joined %s:%d (%s)", rank, world_size, host, port, backend)


def destroy_distributed() -> None:
    global _CONTROL_GROUP, _STORE_SOCKET
    set_tp_group(0, 1, None)
    _CONTROL_GROUP = None
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken world (dead peer) may fail to tear down cleanly
            logger.debug("destroy_process_group failed", exc_info=True)
    if _STORE_SOCKET is not None:
        _STORE_SOCKET.close()
        _STORE_SOCKET = None


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
