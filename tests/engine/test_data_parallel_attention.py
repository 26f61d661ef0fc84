"""Data-parallel attention end to end on CPU/gloo: each DP rank has its own scheduler, requests and KV
pool, the MoE layers run expert-parallel over all ranks, and a DP rank with nothing to run joins the
expert exchanges so the busy ones never hang.  Greedy tokens equal HF transformers' (fp32) at DP=2 and
DP=2 x TP=2, with one rank idle for whole steps; a dense model at DP=2 (no expert parallelism); the
OpenAI server spreading concurrent requests over the DP ranks; every KV block back in every pool."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from roofline import LLM, SamplingParams
from roofline.config import EngineArgs
from roofline.metrics.prometheus import metric_value
from tests.engine.test_feature_invariance import GREEDY
from tests.reference.hf_models import hf_greedy, random_prompts
from tests.router.cluster import assert_kv_idle, completion, metrics, start_engine, stop


def _llm(path, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=128, show_progress=False, **kw)


def _check_pools_idle(llm: LLM) -> None:
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 2 * 128
    for rank in llm.llm_engine.scheduler.ranks:
        assert rank.kv.pool.num_free_blocks == rank.kv.pool.num_blocks and not rank.requests


@pytest.fixture(scope="module")
def mixtral_dp2(moe_models):
    """One DP=2 expert-parallel engine on the tiny Mixtral for the tests below, in file order: the greedy
    check (its first use: the per-rank request counts start at zero), the poisoned request, and last the
    killed rank (which ends it)."""
    path, _, _ = moe_models["mixtral"]
    llm = _llm(path, data_parallel_size=2, enable_expert_parallel=True)
    yield llm
    llm.llm_engine.shutdown()


def test_dp2_expert_parallel_greedy_matches_hf_with_an_idle_rank(moe_models, mixtral_dp2):
    _, prompts, reference = moe_models["mixtral"]
    llm = mixtral_dp2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.llm_engine.scheduler.requests_assigned == [3, 2]
    _check_pools_idle(llm)
    # one request: the other DP rank has nothing to run for every step and joins the exchanges
    steps_before = llm.llm_engine.get_stats().parallel_steps
    out = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[1]
    stats = llm.llm_engine.get_stats()
    assert stats.parallel_steps - steps_before >= GREEDY.max_tokens
    assert stats.collectives["ep.all_to_all"][0] == 4 * 2 * stats.parallel_steps  # 4 per MoE layer, every step
    _check_pools_idle(llm)


def test_dp2_tp2_uneven_lengths_greedy_matches_hf(moe_models):
    """Four ranks; requests of very different lengths, so one DP rank finishes early and idles."""
    path, prompts, full = moe_models["qwen3_moe"]
    lengths = [2, 20, 3, 18, 5]
    reference = [ref[:n] for ref, n in zip(full, lengths)]  # greedy: a shorter run is a prefix of a longer
    llm = _llm(path, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        _check_pools_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_dense_model_dp2_greedy_matches_hf(tiny_models):
    path, hf = tiny_models["llama"]
    prompts = random_prompts(6, 384, 3, 40, seed=5)
    llm = _llm(path, data_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
        assert llm.llm_engine.scheduler.requests_assigned == [3, 3]
        _check_pools_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_server_spreads_requests_over_dp_ranks(moe_models):
    path, prompts, reference = moe_models["mixtral"]
    srv = start_engine(path, num_kv_blocks=64, data_parallel_size=2, enable_expert_parallel=True)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: completion(srv.url, p, GREEDY.max_tokens, stream=True), prompts))
        assert got == reference
        assert_kv_idle(srv)
        m = metrics(srv.url)
        placed = [metric_value(m, "roofline:dp_rank_requests_total", dp_rank=str(d)) for d in range(2)]
        assert sum(placed) == len(prompts) and min(placed) >= 1
        assert metric_value(m, "roofline:dp_rank_num_requests_running", dp_rank="0") == 0
    finally:
        stop(srv)


def test_data_parallel_with_pipeline_stages_is_refused():
    with pytest.raises(ValueError, match="data_parallel_size > 1 needs pipeline_parallel_size 1"):
        EngineArgs(data_parallel_size=2, pipeline_parallel_size=2).create_engine_config()


def test_dp2_eplb_rebalances_mid_generation_greedy_unchanged(moe_models):
    """Token counts from both DP ranks' own batches feed the rebalance; weights move while serving."""
    path, prompts, reference = moe_models["qwen2_moe"]
    llm = _llm(path, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
               eplb_config='{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2}')
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        stats = llm.llm_engine.get_stats()
        assert stats.eplb_rebalances == stats.parallel_steps // 3 >= 2
        _check_pools_idle(llm)
    finally:
        llm.llm_engine.shutdown()


def test_dp2_a_failing_request_fails_alone_and_every_pool_gets_its_blocks_back(moe_models, mixtral_dp2,
                                                                                monkeypatch):
    """Fault isolation re-runs a data-parallel step in halves (each DP rank's part restricted alike, the
    idle rank joining the exchanges): the poisoned request fails, the others keep HF's tokens."""
    _, prompts, reference = moe_models["mixtral"]
    llm = mixtral_dp2
    engine = llm.llm_engine
    real = engine.executor.execute
    poisoned = set()

    def execute(out):
        if any(s.req_id in poisoned for s in out.scheduled):
            raise ValueError("poisoned request")
        return real(out)

    monkeypatch.setattr(engine.executor, "execute", execute)
    poisoned.add(f"llm-{next(llm._counter) + 3}")  # the third prompt of the next call
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert outs[2].error and "poisoned request" in outs[2].error
    assert outs[2].outputs[0].finish_reason == "error"
    for i in (0, 1, 3, 4):
        assert outs[i].error is None and outs[i].outputs[0].token_ids == reference[i]
    _check_pools_idle(llm)


def test_dp2_a_killed_rank_gives_a_clear_error_not_a_hang(moe_models, mixtral_dp2):
    """SIGKILL DP rank 1 mid-generation: rank 0 waits for its output (or in an exchange with it); the
    engine fails naming rank 1, fast."""
    import threading
    import time

    _, prompts, _ = moe_models["mixtral"]
    llm = mixtral_dp2
    llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    killer = threading.Timer(0.5, llm.llm_engine.executor.ranks.by_rank(1).proc.kill)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        while time.monotonic() - t0 < 30:
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    killer.join()
    assert time.monotonic() - t0 < 20
