"""Control-plane collectives on the CPU (gloo) control group: bytes, not tensors.

Messages are msgspec-encoded by the caller; here they travel as uint8 tensors, length first.
Nothing is ever pickled.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from roofline.distributed.parallel_state import get_control_group


def broadcast_bytes(data: Optional[bytes], src: int = 0) -> bytes:
    """Rank `src` passes its bytes, every other rank passes None; all return src's bytes."""
    group = get_control_group()
    is_src = dist.get_rank() == src
    header = torch.tensor([len(data) if is_src else 0], dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    n = int(header.item())
    if n == 0:
        return b""
    if is_src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return bytes(data) if is_src else buf.numpy().tobytes()


def send_bytes(data: bytes, dst: int) -> None:
    """Point-to-point on the control group: these bytes to global rank dst (recv_bytes there)."""
    group = get_control_group()
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group)


def recv_bytes(src: int) -> bytes:
    """The bytes global rank src sent with send_bytes."""
    group = get_control_group()
    header = torch.zeros(1, dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    n = int(header.item())
    if n == 0:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    return buf.numpy().tobytes()


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's bytes, in rank order, on every rank."""
    group = get_control_group()
    world = dist.get_world_size()
    lens = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lens, torch.tensor([len(data)], dtype=torch.int64), group=group)
    sizes = [int(t.item()) for t in lens]
    width = max(max(sizes), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [p[:n].numpy().tobytes() for p, n in zip(parts, sizes)]


def all_reduce_min(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_control_group())
    return int(t.item())


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Each rank's list of ints (same length on every rank), in rank order."""
    world = dist.get_world_size()
    mine = torch.tensor(values, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=get_control_group())
    return [p.tolist() for p in parts]
