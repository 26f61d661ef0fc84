"""The Ray executor on a local Ray cluster of two raylets (ray.cluster_utils.Cluster): greedy output
identical to HF at tp=2 and tp=2 x pp=2 with ranks on both nodes (read from Ray's state API), the
documented rank order, a killed actor failing the engine within seconds with the rank and node named and
every block back in the pool, a placement group that cannot be satisfied failing after its timeout, and
a clear error without Ray."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from roofline import LLM, SamplingParams
from roofline.config import EngineArgs
from roofline.executor.ray_executor import RayExecutor, import_ray, rank_order
from tests.executor.tp_helpers import kill_rank_mid_generation
from tests.reference.hf_models import build_tiny_model, hf_greedy, hf_logprobs, random_prompts

COMMON = dict(dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False,
              distributed_executor_backend="ray")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def cluster():
    """Two raylets of two logical CPUs each (a rank's bundle is {"CPU": 1}: tp=2 x pp=2 needs four)."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, logging_level="WARNING")
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ray-llama"))
    return path, build_tiny_model("llama", path, seed=3, num_hidden_layers=4)


def _rank_nodes(llm: LLM) -> list[str]:
    """Each rank's Ray node id, as Ray's state API lists its actor (the executor's own record checked against it)."""
    ranks = llm.llm_engine.executor.ranks
    alive = {a.actor_id: a.node_id for a in list_actors(filters=[("class_name", "=", "RankActor"),
                                                                   ("state", "=", "ALIVE")])}
    nodes = []
    for p in ranks.procs:
        assert alive[p.where["actor_id"]] == p.where["node_id"]
        nodes.append(p.where["node_id"])
    return nodes


def _check_against_hf(llm: LLM, hf_model) -> None:
    prompts = random_prompts(3, 384, 4, 24, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, out in zip(prompts, outs):
        got = out.outputs[0]
        assert got.token_ids == hf_greedy(hf_model, p, GREEDY.max_tokens)
        ref = hf_logprobs(hf_model, p + got.token_ids[:-1])[len(p) - 1:]
        for i, (tok, lp) in enumerate(zip(got.token_ids, got.logprobs)):
            assert abs(lp[tok].logprob - ref[i, tok].item()) < 1e-4


def test_tp2_pp2_packed_on_two_nodes_matches_hf(cluster, llama):
    """Four ranks on two 2-CPU nodes: each node holds one pipeline stage's tensor-parallel pair (ranks
    0-1 on the engine's node, 2-3 on the other), as the rank order promises."""
    path, hf_model = llama
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **COMMON)
    try:
        nodes = _rank_nodes(llm)
        engine_node = ray.get_runtime_context().get_node_id()
        assert nodes[0] == nodes[1] == engine_node and nodes[2] == nodes[3] != engine_node
        _check_against_hf(llm, hf_model)
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def spread_tp2(cluster, llama):
    """tp=2 with STRICT_SPREAD: one rank on each node.  Checked against HF by the first test below; the
    same engine loses its second node in the module's last test.  (The tp=2 x pp=2 test, which needs all
    four CPUs, runs before it is built.)"""
    llm = LLM(llama[0], tensor_parallel_size=2, ray_placement_strategy="STRICT_SPREAD", **COMMON)
    yield llm
    llm.llm_engine.shutdown()


def test_tp2_spread_over_both_nodes_matches_hf(llama, spread_tp2):
    _, hf_model = llama
    llm = spread_tp2
    assert isinstance(llm.llm_engine.executor, RayExecutor)
    nodes = _rank_nodes(llm)
    assert len(set(nodes)) == 2
    assert nodes[0] == ray.get_runtime_context().get_node_id()  # the engine's node holds rank 0
    _check_against_hf(llm, hf_model)


def _placement_group_states() -> dict[str, str]:
    return {pg_id: t["state"] for pg_id, t in ray.util.placement_group_table().items()}


def test_killed_actor_fails_the_engine_naming_rank_and_node_and_frees_every_block(cluster, llama):
    from roofline.engine.async_llm import AsyncLLM
    from roofline.engine.engine_core import EngineCore

    path, _ = llama
    config = EngineArgs(model=path, tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_blocks=64,
                        max_model_len=512, distributed_executor_backend="ray").create_engine_config()
    core = EngineCore(config, show_progress=False)
    ranks = core.executor.ranks
    pg_id = ranks.pg.id.hex()
    victim = ranks.by_rank(1)
    engine = AsyncLLM(core)
    try:
        elapsed, errors = asyncio.run(kill_rank_mid_generation(
            engine, ranks, 1, kill=lambda: ray.kill(victim.actor, no_restart=True)))
        assert elapsed < 15, elapsed
        for e in errors:
            assert "rank 1" in e and victim.where["ip"] in e and victim.where["node_id"][:12] in e, e
        assert not engine.is_healthy
        stats = core.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
        deadline = time.monotonic() + 15
        while _placement_group_states().get(pg_id) != "REMOVED" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _placement_group_states()[pg_id] == "REMOVED"
    finally:
        engine.shutdown()
        core.shutdown()


def test_unsatisfiable_placement_fails_after_the_timeout(cluster, llama):
    path, _ = llama
    before = set(_placement_group_states())
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"could not place 4 rank\(s\).*STRICT_SPREAD.*within "
                                           r"--ray-placement-timeout 2 s"):
        LLM(path, tensor_parallel_size=4, ray_placement_strategy="STRICT_SPREAD", ray_placement_timeout=2, **COMMON)
    assert time.monotonic() - t0 < 30
    new = {k: v for k, v in _placement_group_states().items() if k not in before}
    assert new and all(v == "REMOVED" for v in new.values())


def test_rank_order_puts_the_engine_node_first_and_keeps_each_node_contiguous():
    bundles = {0: "n-b", 1: "n-a", 2: "n-engine", 3: "n-b", 4: "n-engine", 5: "n-a"}
    ips = {"n-a": "10.0.0.2", "n-b": "10.0.0.1", "n-engine": "10.0.0.9"}
    assert rank_order(bundles, ips, "n-engine") == [2, 4, 0, 3, 1, 5]


def test_without_ray_the_error_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'roofline\[ray\]'"):
        EngineArgs(model="unused", distributed_executor_backend="ray").create_engine_config()
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(RuntimeError, match=r"pip install 'roofline\[ray\]'"):
        import_ray()


def test_ray_flags_are_checked():
    for kw, what in ((dict(distributed_executor_backend="slurm"), "distributed_executor_backend"),
                     (dict(distributed_executor_backend="ray", ray_placement_strategy="RANDOM"),
                      "ray_placement_strategy"),
                     (dict(distributed_executor_backend="ray", nnodes=2), "--nnodes")):
        with pytest.raises(ValueError, match=what):
            EngineArgs(model="unused", **kw).create_engine_config()


def test_lost_node_fails_the_idle_engine_naming_the_rank_and_node(cluster, spread_tp2):
    """The second raylet goes away (its processes killed) while the engine is idle: check_health() names
    the rank that lived there and its node within seconds, and the next request fails at once.  Last in
    the module: the cluster keeps one node."""
    llm = spread_tp2
    core = llm.llm_engine
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    lost = core.executor.ranks.by_rank(1)
    worker_node = next(n for n in cluster.worker_nodes if n.node_id == lost.where["node_id"])
    cluster.remove_node(worker_node)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        while time.monotonic() - t0 < 30:
            core.check_health()
            time.sleep(0.2)
    assert time.monotonic() - t0 < 10
    assert "rank 1" in str(err.value) and lost.where["node_id"][:12] in str(err.value), err.value
    t1 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert time.monotonic() - t1 < 5
