"""The rendezvous store listens on the configured address only, and the world's keys hide under a prefix
derived from the launch's shared secret: a process without the secret cannot see or join the world."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from roofline import LLM
from roofline.distributed.launch import free_port
from roofline.distributed.parallel_state import rendezvous_store


def listening_addresses(pids: list[int]) -> list[tuple[str, str, int]]:
    """(family, hex address, port) of every listening TCP socket the processes hold (Linux /proc)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for fam in ("tcp", "tcp6"):
        for line in open(f"/proc/net/{fam}").read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                addr, port = f[1].split(":")
                out.append((fam, addr, int(port, 16)))
    return out


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc")
def test_every_rank_socket_listens_on_loopback_only(tiny_models):
    path, _ = tiny_models["llama"]
    llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=32, tensor_parallel_size=2, show_progress=False)
    try:
        pids = [p.proc.pid for p in llm.llm_engine.executor.ranks.procs]
        socks = listening_addresses(pids)
        assert socks, "the ranks listen somewhere (store, gloo pairs)"
        loopback = {("tcp", "0100007F"), ("tcp6", "00000000000000000000000001000000")}
        assert all((fam, addr) in loopback for fam, addr, _ in socks), socks
    finally:
        llm.llm_engine.shutdown()


def test_keys_are_invisible_without_the_secret():
    port = free_port()
    ours = rendezvous_store(0, 1, "127.0.0.1", port, "right-secret", 10.0)
    ours.set("rank-0-address", "x")
    stranger = rendezvous_store(1, 1, "127.0.0.1", port, "wrong-guess", 10.0)
    assert not stranger.check(["rank-0-address"])
    friend = rendezvous_store(1, 1, "127.0.0.1", port, "right-secret", 10.0)
    assert friend.get("rank-0-address") == b"x"
    with pytest.raises(ValueError, match="ROOFLINE_DIST_SECRET"):
        rendezvous_store(1, 1, "127.0.0.1", port, "", 10.0)
    del stranger, friend, ours


def test_multinode_without_a_secret_is_refused(monkeypatch):
    from roofline.config import ParallelConfig
    from roofline.distributed.launch import node_layout

    monkeypatch.delenv("ROOFLINE_DIST_SECRET", raising=False)
    with pytest.raises(ValueError, match="ROOFLINE_DIST_SECRET"):
        node_layout(ParallelConfig(tensor_parallel_size=2, nnodes=2, master_port=free_port()), "cpu")
    assert len(node_layout(ParallelConfig(tensor_parallel_size=2), "cpu").secret) == 32
