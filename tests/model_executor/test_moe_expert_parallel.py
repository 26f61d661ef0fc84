"""Expert parallelism in FusedMoE (layers/moe/expert_parallel.py) over real gloo worlds: every rank
holds whole experts (with and without redundant replicas), tokens go to their experts' ranks and back
by all_to_all_single (also as two overlapped micro-batches, --enable-dbo) or by all-gather +
reduce-scatter, and every DP rank's output equals the single-rank reference on its own batch -- also when a
TP rank's share of the tokens, a micro-batch, or the whole batch is empty."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from roofline.distributed import parallel_state as ps
from roofline.distributed.launch import free_port
from roofline.distributed.layout import ParallelLayout
from roofline.model_executor.layers.moe import FusedMoE, RoutingConfig, select_experts
from roofline.model_executor.layers.moe.expert_parallel import ExpertMap, dual_batch_step
from roofline.model_executor.layers.moe.torch_experts import torch_experts
from roofline.eplb.algorithm import Placement

E, H, INTER = 8, 32, 24
ROUTING = RoutingConfig(top_k=2, renormalize=True)


def _weights():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(E, INTER, H, generator=g) * 0.2, torch.randn(E, INTER, H, generator=g) * 0.2,
            torch.randn(E, H, INTER, generator=g) * 0.2)


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(n, H, generator=g), torch.randn(n, E, generator=g)


# Both layouts in one set of processes: all four ranks form the EP4 world, then ranks 0 and 1 the EP2 one.
LAYOUTS = {"EP4=DP2xTP2": (2, 2), "EP2=TP2": (2, 1)}


def _rank_main(rank: int, ports: list[int], errors) -> None:
    torch.set_num_threads(1)
    for (name, (tp, dp)), port in zip(LAYOUTS.items(), ports):
        if rank >= tp * dp:
            return
        try:
            _check_layout(rank, port, tp, dp)
        except BaseException as e:
            errors.put(f"{name} rank {rank}: {type(e).__name__}: {e}")
            raise
        finally:
            ps.destroy_distributed()


def _check_layout(rank: int, port: int, tp: int, dp: int) -> None:
    gate, up, down = _weights()
    ref_w13, ref_w2 = torch.cat([gate, up], dim=1), down
    ps.init_distributed(rank, tp * dp, "127.0.0.1", port, "test-secret", "gloo", 60.0)
    for backend, dual in (("all_to_all", False), ("allgather_reducescatter", False), ("all_to_all", True)):
        dual_batch_step(dual)  # --enable-dbo: the all_to_all exchange as two overlapped micro-batches
        for redundant in (0, tp * dp):
            layout = ParallelLayout(tp=tp, dp=dp, expert_parallel=True, num_redundant_experts=redundant,
                                    all2all_backend=backend)
            ps.init_model_parallel(layout)
            layer = FusedMoE(E, H, INTER, ROUTING)
            assert layer.w13_weight.shape[0] == (E + redundant) // (tp * dp)
            for e in range(E):
                layer.weight_loader(layer.w13_weight, gate[e], "w1", e)
                layer.weight_loader(layer.w13_weight, up[e], "w3", e)
                layer.weight_loader(layer.w2_weight, down[e], "w2", e)
            assert layer.missing_experts() == []
            dp_rank = layout.coords(rank).dp
            for n in (13, 1, 0):  # one token: one TP rank's share (and a micro-batch) empty; none: all empty
                x, logits = _batch(n + dp_rank, dp_rank)  # DP ranks' batches differ, in size too
                w, ids = select_experts(logits, ROUTING)
                ps.reset_collective_counts()
                y = layer(x, logits)
                torch.testing.assert_close(y, torch_experts(x, ref_w13, ref_w2, w, ids), rtol=1e-5, atol=1e-5)
                stats = ps.collective_stats()
                if dual:  # both halves' counts in one; per half: slots, hidden out, outputs back
                    assert stats["ep.all_to_all"][0] == 7, stats
                elif backend == "all_to_all":
                    assert stats["ep.all_to_all"][0] == 4, stats  # counts, slots, hidden out, outputs back
                else:
                    assert stats["ep.all_gather"][0] == 4 and stats["ep.reduce_scatter"][0] == 1, stats


def test_expert_parallel_layer_matches_the_reference():
    """Every layout of LAYOUTS; a failure names its layout and rank."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    ports = [free_port() for _ in LAYOUTS]
    world = max(tp * dp for tp, dp in LAYOUTS.values())
    procs = [ctx.Process(target=_rank_main, args=(r, ports, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    for p in procs:
        if p.is_alive():
            p.kill()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, messages
    assert [p.exitcode for p in procs] == [0] * world


def test_replicas_are_taken_in_turn():
    placement = Placement((0, 1, 0, 2), num_logical=3, num_ranks=2)
    m = ExpertMap(placement, ep_rank=1)
    assert m.local_logical == (0, 2)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [2, 0]])
    phys = m.choose(ids)
    assert phys[:, 0].tolist()[:3] == [0, 2, 0]  # expert 0's replicas (slots 0 and 2) alternate by token
    assert set(phys.reshape(-1).tolist()) <= {0, 1, 2, 3}
    assert all(placement.physical_to_logical[p] == e for p, e in zip(phys.reshape(-1).tolist(), ids.reshape(-1).tolist()))
