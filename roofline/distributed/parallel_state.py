"""The process groups a rank belongs to -- TP, PP, DP, EP -- and the collectives layers call on them.

One registry: `init_model_parallel(layout)` creates every group of a `ParallelLayout` (layout.py:
world = DP x PP x TP, the experts' EP group spanning DP x TP) and `get_tp_group()`, `get_pp_group()`,
`get_dp_group()`, `get_ep_group()` return this rank's `GroupCoordinator` of each kind.  With no world
(one device) every group is this rank alone and every collective is the identity, so model code reads
the same at any layout.  Each coordinator counts its collectives and their bytes (for /metrics and
tests).

`init_distributed` joins the torch.distributed world (gloo on CPU, NCCL on CUDA) and creates the CPU
(gloo) *control* group that carries the engine's messages from rank 0 to the others
(roofline.distributed.comm); the model groups follow once the configuration has arrived.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from roofline.distributed.layout import ParallelLayout

logger = logging.getLogger(__name__)

# The control group waits for the next engine message for as long as the engine stays idle, so its
# timeout is effectively infinite; a peer that dies still breaks the wait at once (closed socket).
CONTROL_TIMEOUT = timedelta(days=365)
GROUP_KINDS = ("tp", "pp", "dp", "ep")


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


@dataclass
class GroupCoordinator:
    """One group of ranks (global ranks in group order) as seen by one member, and its collectives.

    Counters: `stats[op] = [calls, bytes]`, bytes being what this rank hands to the collective (for
    all_to_all_single: what it sends to the *other* members)."""

    kind: str
    ranks: list[int]
    rank_in_group: int
    group: Optional[object] = None  # torch.distributed ProcessGroup; None for a group of one or a meta build
    stats: dict[str, list[int]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank_in_group]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping): the next pipeline stage in a PP group."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _count(self, op: str, nbytes: int) -> None:
        s = self.stats.setdefault(op, [0, 0])
        s[0] += 1
        s[1] += nbytes

    def _need_group(self, op: str) -> None:
        if self.group is None:
            raise RuntimeError(f"{self.kind} group of {self.world_size} ranks has no process group ({op} in a "
                               "meta-device build?)")

    # ---- collectives (identity for a group of one) -----------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place."""
        if self.world_size == 1:
            return x
        self._need_group("all_reduce")
        self._count("all_reduce", _nbytes(x))
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every member's x (same shape) concatenated along dim, in group order."""
        if self.world_size == 1:
            return x
        self._need_group("all_gather")
        x = x.contiguous()
        self._count("all_gather", _nbytes(x))
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """x [world_size * n, ...] summed over the group; this member keeps rows [rank_in_group * n, ...)."""
        if self.world_size == 1:
            return x
        self._need_group("reduce_scatter")
        if x.shape[0] % self.world_size:
            raise ValueError(f"reduce_scatter: {x.shape[0]} rows do not split over {self.world_size} ranks")
        x = x.contiguous()
        self._count("reduce_scatter", _nbytes(x))
        out = torch.empty_like(x[: x.shape[0] // self.world_size])
        dist.reduce_scatter(out, list(x.chunk(self.world_size)), group=self.group)
        return out

    def all_to_all_single(self, x: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
        """Rows [sum(in_splits[:j]), +in_splits[j]) of x go to member j; the result holds what every
        member sent here, in group order (out_splits[j] rows from member j)."""
        if self.world_size == 1:
            return x
        self._need_group("all_to_all")
        x = x.contiguous()
        row = _nbytes(x[:1]) if x.shape[0] else 0
        self._count("all_to_all", row * (sum(in_splits) - in_splits[self.rank_in_group]))
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group)
        return out

    def all_to_all_single_async(self, x: torch.Tensor, in_splits: list[int], out_splits: list[int]):
        """all_to_all_single issued without waiting: (the result tensor, a handle whose wait() completes it).
        Every member issues its async collectives in the same order (they complete in that order)."""
        self._need_group("all_to_all")
        x = x.contiguous()
        row = _nbytes(x[:1]) if x.shape[0] else 0
        self._count("all_to_all", row * (sum(in_splits) - in_splits[self.rank_in_group]))
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        work = dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=self.group, async_op=True)
        return out, work

    def broadcast(self, x: torch.Tensor, src_in_group: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return x
        self._need_group("broadcast")
        self._count("broadcast", _nbytes(x) if self.rank_in_group == src_in_group else 0)
        dist.broadcast(x, src=self.ranks[src_in_group], group=self.group)
        return x

    def send(self, x: torch.Tensor, dst_in_group: int) -> None:
        """Point-to-point (e.g. to the next pipeline stage: dst_in_group = (rank_in_group + 1) % size)."""
        self._need_group("send")
        self._count("send", _nbytes(x))
        send_without_waiting(x, self.ranks[dst_in_group], self.group)

    def recv(self, x: torch.Tensor, src_in_group: int) -> torch.Tensor:
        """Receive into x (its shape and dtype must match what the sender sent)."""
        self._need_group("recv")
        self._count("recv", _nbytes(x))
        dist.recv(x, src=self.ranks[src_in_group], group=self.group)
        return x


def _alone(kind: str, rank: int = 0) -> GroupCoordinator:
    return GroupCoordinator(kind, [rank], 0)


_LAYOUT = ParallelLayout()
_GROUPS: dict[str, GroupCoordinator] = {k: _alone(k) for k in GROUP_KINDS}
_CONTROL_GROUP: Optional[object] = None


def get_layout() -> ParallelLayout:
    return _LAYOUT


def get_tp_group() -> GroupCoordinator:
    return _GROUPS["tp"]


def get_pp_group() -> GroupCoordinator:
    return _GROUPS["pp"]


def get_dp_group() -> GroupCoordinator:
    return _GROUPS["dp"]


def get_ep_group() -> GroupCoordinator:
    return _GROUPS["ep"]


def get_tp_rank() -> int:
    return _GROUPS["tp"].rank_in_group


def get_tp_size() -> int:
    return _GROUPS["tp"].world_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return _GROUPS["tp"].all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate each TP rank's shard along dim (rank order)."""
    return _GROUPS["tp"].all_gather(x, dim)


def _coordinators(layout: ParallelLayout, rank: int, make_group=None) -> dict[str, GroupCoordinator]:
    """This rank's coordinator of every kind; make_group(ranks) -> ProcessGroup is called for every group
    of every kind in the same order on all ranks (torch.distributed.new_group's rule), None: meta build."""
    out = {}
    for kind in GROUP_KINDS:
        for ranks in layout.groups(kind):
            group = make_group(ranks) if make_group is not None and len(ranks) > 1 else None
            if rank in ranks:
                out[kind] = GroupCoordinator(kind, list(ranks), ranks.index(rank), group)
    return out


@contextlib.contextmanager
def parallel_layout_as(layout: ParallelLayout, rank: int):
    """Build layers as `rank` of `layout` without joining a world (meta-device shape checks, tests)."""
    global _LAYOUT, _GROUPS
    saved = _LAYOUT, _GROUPS
    _LAYOUT, _GROUPS = layout, _coordinators(layout, rank)
    try:
        yield
    finally:
        _LAYOUT, _GROUPS = saved


def tp_group_as(rank: int, world_size: int):
    """parallel_layout_as for a pure tensor-parallel world."""
    return parallel_layout_as(ParallelLayout(tp=world_size), rank)


def get_control_group():
    if _CONTROL_GROUP is None:
        raise RuntimeError("torch.distributed is not initialized in this process (init_distributed)")
    return _CONTROL_GROUP


def collective_stats() -> dict[str, list[int]]:
    """{"<kind>.<op>": [calls, bytes]} issued by the model in this process since the last reset."""
    return {f"{k}.{op}": list(v) for k, g in _GROUPS.items() for op, v in sorted(g.stats.items())}


def collective_counts() -> tuple[int, int]:
    """(all-reduces, all-gathers) issued on the TP group since the last reset."""
    s = _GROUPS["tp"].stats
    return s.get("all_reduce", [0, 0])[0], s.get("all_gather", [0, 0])[0]


def reset_collective_counts() -> None:
    for g in _GROUPS.values():
        g.stats.clear()


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
    if not secret:
        raise ValueError("joining a distributed world needs its shared secret (ROOFLINE_DIST_SECRET)")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        listener = _store_listener(host, port)
        try:
            store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.fileno())
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store's server owns the socket now and closes it when the store goes
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    return dist.PrefixStore(f"roofline-{secret}/", store)


def init_distributed(rank: int, world_size: int, host: str, port: int, secret: str, backend: str = "gloo",
                     timeout_s: float = 600.0) -> None:
    """Join the world: rendezvous through rank 0's store at host:port (rendezvous_store), then the world
    process group with `backend` plus a gloo group for control messages (CPU bytes, also under NCCL).
    The model groups come from init_model_parallel."""
    global _CONTROL_GROUP
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed_backend must be 'gloo' or 'nccl', got {backend!r}")
    store = rendezvous_store(rank, world_size, host, port, secret, timeout_s)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    logger.debug("rank %d/%d joined %s:%d (%s)", rank, world_size, host, port, backend)


def init_model_parallel(layout: ParallelLayout) -> None:
    """Create every TP, PP, DP and EP group of `layout` (collectively: every rank calls this) and make
    this rank's the current ones."""
    global _LAYOUT, _GROUPS
    world, rank = dist.get_world_size(), dist.get_rank()
    if layout.world_size != world:
        raise ValueError(f"layout {layout.describe()} needs {layout.world_size} ranks, the world has {world}")

    def make_group(ranks: list[int]):
        if len(ranks) == world:
            return dist.group.WORLD
        return dist.new_group(ranks)

    _LAYOUT, _GROUPS = layout, _coordinators(layout, rank, make_group)
    logger.debug("rank %d: %s", rank, layout.describe())


def destroy_distributed() -> None:
    global _CONTROL_GROUP, _LAYOUT, _GROUPS
    _LAYOUT, _GROUPS = ParallelLayout(), {k: _alone(k) for k in GROUP_KINDS}
    _CONTROL_GROUP = None
    _finish_sends(SEND_DRAIN_S)  # a receiver still takes what was sent; a broken world's sends are dropped
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken world (dead peer) may fail to tear down cleanly
            logger.debug("destroy_process_group failed", exc_info=True)


# Sends in flight: (work, tensor) -- the tensor must live until its send completes.
_pending_sends: list = []


def send_without_waiting(x: torch.Tensor, dst: int, group) -> None:
    """Point-to-point send of x to global rank dst that returns before the receiver takes it.

    dist.send on gloo blocks until the receiver has posted its recv (a rendezvous, measured: a send to a
    rank that posts its recv 1 s later takes 1 s), which serialized the pipeline stages: rank 0 could not
    hand step n+1 to a stage still running step n.  isend keeps order per (pair, group); the tensor is held
    here until the send completes.  A failed earlier send raises at the next send."""
    _reap_sends()
    x = x.contiguous()
    _pending_sends.append((dist.isend(x, dst=dst, group=group), x))


SEND_DRAIN_S = 5.0  # at shutdown: how long the sends in flight may take, all together


def _finish_sends(budget_s: float) -> None:
    """Wait for the sends in flight, within budget_s in all, then drop what is left (a peer that died
    never takes them; tearing the group down under a live send would cut the receiver off)."""
    deadline = time.monotonic() + budget_s
    while _pending_sends:
        work, _ = _pending_sends.pop(0)
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            work.wait(timedelta(seconds=left))
        except Exception:  # the peer is gone: the rest cannot complete either
            break
    _pending_sends.clear()


def _reap_sends() -> None:
    while _pending_sends and _pending_sends[0][0].is_completed():
        work, _ = _pending_sends.pop(0)
        work.wait()  # completed: raises if it failed
