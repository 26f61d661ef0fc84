"""Tensor parallelism end to end on CPU with gloo: one worker process per rank.

Greedy outputs equal tp=1 (a flip only at a proven tie), the collectives per step are counted on
every rank, each rank's KV pool holds only its heads, and faults fail fast: a dead worker makes
execute()/check_health() raise and in-flight requests error out; a rank that fails at start-up
fails the launch with its own error."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from roofline import LLM, SamplingParams
from tests.executor.tp_helpers import assert_same_greedy, kill_rank_mid_generation
from tests.reference.hf_models import build_tiny_model, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
COMMON = dict(dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)


def _prompts(vocab: int, n: int = 5):
    return [{"prompt_token_ids": p} for p in random_prompts(n, vocab, 3, 40, seed=7)]


@pytest.fixture(scope="module")
def llama_tp2(tiny_models):
    path, _ = tiny_models["llama"]
    llm = LLM(path, tensor_parallel_size=2, **COMMON)
    yield path, llm
    llm.llm_engine.shutdown()


def _tp1(path: str, **kw) -> LLM:
    return LLM(path, **dict(COMMON, **kw))


def test_llama_tp2_greedy_matches_tp1(llama_tp2):
    path, llm = llama_tp2
    prompts = _prompts(384)
    ref = _tp1(path).generate(prompts, GREEDY, use_tqdm=False)
    assert_same_greedy(ref, llm.generate(prompts, GREEDY, use_tqdm=False))


def test_llama_tp2_counts_collectives_on_every_rank(llama_tp2):
    """Per forward pass: 1 (embedding) + 2 per decoder layer all-reduces; 1 all-gather per logits."""
    _, llm = llama_tp2
    core = llm.llm_engine
    ex = core.executor
    layers = core.model_config.hf_config.num_hidden_layers
    ex.reset_collective_counts()
    core.add_request("count-a", [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.add_request("count-b", [11, 12, 13], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        counts = ex.collective_counts()
        assert len(counts) == 2
        assert all(c == [steps * (1 + 2 * layers), steps] for c in counts), (steps, counts)
    assert steps == 3


def test_tp2_kv_pool_per_rank(llama_tp2):
    path, llm = llama_tp2
    full = _tp1(path).llm_engine.executor.block_bytes()
    assert llm.llm_engine.executor.block_bytes() * 2 == full  # 2 KV heads: one per rank


def test_qwen3_tp2_greedy_matches_tp1(tiny_models):
    path, _ = tiny_models["qwen3"]
    prompts = _prompts(384)
    ref = _tp1(path).generate(prompts, GREEDY, use_tqdm=False)
    # a per-rank KV budget: each rank's blocks are half as big, so it fits twice the blocks
    llm = LLM(path, tensor_parallel_size=2, **dict(COMMON, num_kv_blocks=None, kv_cache_memory=1 << 20))
    try:
        one = _tp1(path, num_kv_blocks=None, kv_cache_memory=1 << 20).llm_engine
        assert llm.llm_engine.kv_capacity_tokens == 2 * one.kv_capacity_tokens
        assert_same_greedy(ref, llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.llm_engine.shutdown()


def test_replicated_kv_heads_then_idle_worker_death(tmp_path):
    """One KV head, two ranks: both ranks hold (a copy of) it and outputs equal tp=1.  Then a rank
    dies while the engine is idle: check_health() sees it with no request in flight, and the next
    request fails at once instead of hanging."""
    path = str(tmp_path / "llama-kv1")
    build_tiny_model("llama", path, seed=2, num_key_value_heads=1)
    prompts = _prompts(384, 3)
    ref = _tp1(path).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **COMMON)
    core = llm.llm_engine
    try:
        assert_same_greedy(ref, llm.generate(prompts, GREEDY, use_tqdm=False))
        assert core.executor.block_bytes() == _tp1(path).llm_engine.executor.block_bytes()

        core.check_health()
        p = core.executor.ranks.by_rank(1).proc
        p.kill()
        p.wait(10)
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            core.check_health()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1"):
            llm.generate(prompts[0], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 5
    finally:
        core.shutdown()


def test_worker_death_fails_fast(llama_tp2):
    """SIGKILL a rank mid-generation: in-flight requests get an error, health turns bad, no hang.  The
    module's tp=2 engine (max_model_len 512), served through AsyncLLM; this is the last test to use it."""
    from roofline.engine.async_llm import AsyncLLM

    _, llm = llama_tp2
    core = llm.llm_engine
    assert core.model_config.max_model_len == 512
    ex = core.executor
    ranks = ex.ranks
    engine = AsyncLLM(core)
    try:
        elapsed, errors = asyncio.run(kill_rank_mid_generation(engine, ranks, 1))
        assert elapsed < 15, elapsed
        assert all("rank 1" in e for e in errors), errors
        assert not engine.is_healthy
        stats = core.get_stats()  # the dead executor's requests were aborted in the core: every block is back
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
        with pytest.raises(RuntimeError, match="rank 1"):
            core.check_health()
        with pytest.raises(RuntimeError, match="rank 1"):
            core.executor.execute(None)  # refused at once, nothing sent
        # the surviving rank was stopped too
        deadline = time.monotonic() + 15
        while ranks.by_rank(0).proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ranks.by_rank(0).proc.poll() is not None
    finally:
        engine.shutdown()
        core.shutdown()


def test_bad_head_split_fails_before_any_process_starts(tiny_models):
    path, _ = tiny_models["llama"]  # 4 query heads, 2 KV heads
    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        LLM(path, tensor_parallel_size=3, **COMMON)
    assert "num_attention_heads (4) is not divisible by tensor_parallel_size (3)" in str(e.value)
    assert time.monotonic() - t0 < 10


def test_one_rank_failing_at_startup_fails_the_launch(tiny_models, monkeypatch):
    from roofline.config import EngineArgs, finalize_lengths
    from roofline.executor.multiproc import MultiprocExecutor
    from roofline.model_executor.loader.source import load_hf_config, resolve_source

    # the worker processes import the faulty worker class from this repository's tests package
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    path, _ = tiny_models["llama"]
    config = EngineArgs(model=path, tensor_parallel_size=2, device="cpu", dtype="float32").create_engine_config()
    source = resolve_source(path)
    config.model_config.hf_config = load_hf_config(source)
    finalize_lengths(config, 512)
    with pytest.raises(RuntimeError) as e:
        MultiprocExecutor(config, source, show_progress=False,
                          worker_cls="tests.executor.tp_helpers:FailOnRank1Worker")
    msg = str(e.value)
    assert "rank 1" in msg and "MemoryError: rank 1 could not allocate its shard (injected)" in msg
    assert "rank 0" not in msg and "ranks 0" not in msg
