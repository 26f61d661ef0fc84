"""The group registry over a real gloo world of 4 processes laid out DP=2 x TP=2 with expert
parallelism: each group's collectives reach exactly its members (all-reduce, all-gather,
reduce-scatter, all-to-all with uneven splits, point-to-point) and every call is counted with its bytes;
without a world every group is this rank alone and collectives are the identity."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from roofline.distributed import parallel_state as ps
from roofline.distributed.launch import free_port
from roofline.distributed.layout import ParallelLayout

LAYOUT = ParallelLayout(tp=2, dp=2, expert_parallel=True)


def _rank_main(rank: int, port: int, errors) -> None:
    try:
        torch.set_num_threads(1)
        ps.init_distributed(rank, LAYOUT.world_size, "127.0.0.1", port, "test-secret", "gloo", 60.0)
        ps.init_model_parallel(LAYOUT)
        tp, dp, ep, pp = ps.get_tp_group(), ps.get_dp_group(), ps.get_ep_group(), ps.get_pp_group()
        assert tp.ranks == LAYOUT.group_of("tp", rank) and dp.ranks == LAYOUT.group_of("dp", rank)
        assert ep.ranks == [0, 1, 2, 3] and pp.ranks == [rank] and pp.is_first_rank and pp.is_last_rank
        x = torch.tensor([float(rank)])
        assert tp.all_reduce(x.clone()).item() == sum(tp.ranks)
        assert dp.all_reduce(x.clone()).item() == sum(dp.ranks)
        assert ep.all_gather(x, dim=0).tolist() == [0.0, 1.0, 2.0, 3.0]
        # reduce-scatter: member j keeps the sum of everyone's rows j
        rows = torch.arange(4, dtype=torch.float32) * (rank + 1)
        assert ep.reduce_scatter(rows).tolist() == [float(ep.rank_in_group) * 10]
        # all-to-all: rank r sends (r + 1) rows to each peer, valued 100 r + peer
        in_splits = [rank + 1] * 4
        send = torch.cat([torch.full((rank + 1, 2), 100.0 * rank + j) for j in range(4)])
        got = ep.all_to_all_single(send, in_splits, [j + 1 for j in range(4)])
        want = torch.cat([torch.full((j + 1, 2), 100.0 * j + rank) for j in range(4)])
        assert torch.equal(got, want)
        # point to point inside the DP group
        if dp.is_first_rank:
            dp.send(torch.tensor([7.0 + rank]), dp.rank_in_group + 1)
        else:
            assert dp.recv(torch.empty(1), 0).item() == 7.0 + dp.prev_rank
        stats = ps.collective_stats()
        assert stats["tp.all_reduce"] == [1, 4] and stats["dp.all_reduce"] == [1, 4]
        assert stats["ep.all_gather"] == [1, 4] and stats["ep.reduce_scatter"] == [1, 16]
        assert stats["ep.all_to_all"] == [1, 3 * (rank + 1) * 2 * 4]  # rows to the 3 others x 8 bytes
        assert ps.collective_counts() == (1, 0)
        ps.reset_collective_counts()
        assert ps.collective_stats() == {}
    except BaseException as e:  # reported to the test, which fails with it
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        ps.destroy_distributed()


def test_groups_over_a_real_world():
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, errors)) for r in range(LAYOUT.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, messages
    assert [p.exitcode for p in procs] == [0] * 4


def test_without_a_world_every_group_is_this_rank_alone():
    for get in (ps.get_tp_group, ps.get_pp_group, ps.get_dp_group, ps.get_ep_group):
        g = get()
        assert (g.ranks, g.world_size, g.is_first_rank, g.is_last_rank) == ([0], 1, True, True)
        x = torch.ones(3)
        assert g.all_reduce(x) is x and g.all_gather(x) is x and g.all_to_all_single(x, [3], [3]) is x
    assert ps.collective_stats() == {}


def test_layout_as_builds_as_a_rank_without_a_world():
    with ps.parallel_layout_as(ParallelLayout(tp=2, dp=2, expert_parallel=True), 3):
        assert (ps.get_tp_rank(), ps.get_tp_size()) == (1, 2)
        assert ps.get_ep_group().rank_in_group == 3 and ps.get_dp_group().ranks == [1, 3]
        assert ps.get_layout().ep == 4
    assert ps.get_tp_size() == 1 and ps.get_layout().world_size == 1


def test_the_store_owns_its_listening_socket():
    """TCPStore(master_listen_fd=...) closes the socket it was handed when it goes: rank 0 must not close
    that descriptor again (its number may by then be another file's)."""
    import gc
    import os
    import socket

    port = free_port()
    store = ps.rendezvous_store(0, 1, "127.0.0.1", port, "test-secret", 10.0)
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
    gc.collect()  # the store's server closes the listening socket here
    r, w = os.pipe()  # likely to take the freed descriptor numbers
    try:
        ps.destroy_distributed()
        os.fstat(r), os.fstat(w)  # still open: nothing closed them behind their back
        with socket.socket() as s:  # and the port is free again
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        os.close(r)
        os.close(w)
