"""Two "nodes" on loopback: node 0 is this process (the engine, rank 0 in a worker process),
node 1 is `python -m roofline.entrypoints.worker_cmd --node-rank 1` (rank 1), torchrun-style
rendezvous at 127.0.0.1:PORT.  Outputs must equal tp=1 and node 1 must exit cleanly on shutdown."""

from __future__ import annotations

import subprocess
import sys

from roofline import LLM, SamplingParams
from roofline.distributed.launch import free_port
from tests.executor.tp_helpers import assert_same_greedy
from tests.reference.hf_models import random_prompts


def test_two_nodes_on_loopback(tiny_models, monkeypatch):
    monkeypatch.setenv("ROOFLINE_DIST_SECRET", "test-secret-shared-by-both-nodes")
    path, _ = tiny_models["llama"]
    port = free_port()
    flags = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "roofline.entrypoints.worker_cmd", path, *flags,
                              "--node-rank", "1", "--device", "cpu", "--log-level", "WARNING"])
    llm = None
    try:
        llm = LLM(path, tensor_parallel_size=2, nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port,
                  dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
        ex = llm.llm_engine.executor
        info = ex.rank_info()
        assert [r for r, _, _ in info] == [0, 1]
        assert [p.rank for p in ex.ranks.procs] == [0], "node 0 runs only rank 0"
        assert info[1][2] != ex.ranks.by_rank(0).proc.pid
        prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 384, 3, 30, seed=11)]
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
        ref = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
        assert_same_greedy(ref.generate(prompts, sp, use_tqdm=False), llm.generate(prompts, sp, use_tqdm=False))
        llm.llm_engine.shutdown()
        assert node1.wait(timeout=60) == 0, "node 1 exits cleanly when node 0 shuts down"
    finally:
        if llm is not None:
            llm.llm_engine.shutdown()
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_worker_cmd_rejects_node_zero():
    from roofline.entrypoints.worker_cmd import main

    assert main(["-tp", "2", "--nnodes", "2", "--node-rank", "0"]) == 2
