"""Expert parallelism and EPLB end to end on CPU/gloo against HF transformers' greedy tokens (fp32):
the tiny MoE checkpoints of test_moe_models at EP=2 (TP=2) and EP=4 (DP=2 x TP=2) with either token
exchange, and with EPLB rebalancing (redundant replicas, weights moved between ranks) several times in
the middle of generation; the collectives are counted per group in the engine's stats, every KV block
is back in the pool after each run."""

from __future__ import annotations

import pytest

from roofline import LLM
from roofline.eplb.algorithm import initial_placement
from tests.engine.test_feature_invariance import GREEDY
from tests.reference.hf_models import TINY_MOE


def _moe_layers(arch: str) -> int:
    return 2  # every tiny MoE config has two sparse layers (qwen2_moe: 1 and 5)


def _ep_llm(path, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=256, show_progress=False,
               enable_expert_parallel=True, **kw)


def _run(llm, prompts):
    outs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                          use_tqdm=False)]
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    placements = llm.llm_engine.executor.expert_placements()
    return outs, stats, placements


def _generate(path, prompts, **kw):
    llm = _ep_llm(path, **kw)
    try:
        return _run(llm, prompts)
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def mixtral_ep2(moe_models):
    """EP=2 (TP=2) on the tiny Mixtral: checked against HF by test_ep2_greedy_matches_hf, then the same
    engine has a rank killed by the last test of the module."""
    llm = _ep_llm(moe_models["mixtral"][0], tensor_parallel_size=2)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("arch", list(TINY_MOE))
def test_ep2_greedy_matches_hf(moe_models, arch, request):
    path, prompts, reference = moe_models[arch]
    if arch == "mixtral":  # its first run (the collective counts below are the engine's totals)
        outs, stats, placements = _run(request.getfixturevalue("mixtral_ep2"), prompts)
    else:
        outs, stats, placements = _generate(path, prompts, tensor_parallel_size=2)
    assert outs == reference
    assert placements == [[list(range(0, 4))] * 2, [list(range(4, 8))] * 2]  # whole experts, 4 per rank
    # all_to_all: counts, slots, hidden states out, outputs back: 4 per MoE layer per step
    calls, nbytes = stats.collectives["ep.all_to_all"]
    assert calls == 4 * _moe_layers(arch) * stats.parallel_steps and nbytes > 0
    assert stats.collectives["tp.all_reduce"][0] > 0


@pytest.mark.parametrize("arch,backend", [("mixtral", "allgather_reducescatter"), ("qwen3_moe", "all_to_all")])
def test_ep4_over_dp2_tp2_greedy_matches_hf(moe_models, arch, backend):
    path, prompts, reference = moe_models[arch]
    outs, stats, placements = _generate(path, prompts, tensor_parallel_size=2, data_parallel_size=2,
                                        all2all_backend=backend)
    assert outs == reference
    assert [p[0] for p in placements] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    if backend == "all_to_all":
        assert stats.collectives["ep.all_to_all"][0] == 4 * 2 * stats.parallel_steps
    else:
        assert stats.collectives["ep.reduce_scatter"][0] == 2 * stats.parallel_steps
        assert "ep.all_to_all" not in stats.collectives


def test_eplb_rebalances_mid_generation_and_greedy_is_unchanged(moe_models):
    path, prompts, reference = moe_models["qwen2_moe"]
    outs, stats, placements = _generate(
        path, prompts, tensor_parallel_size=2, enable_eplb=True,
        eplb_config='{"window_size": 4, "step_interval": 3, "num_redundant_experts": 2, "log_balancedness": true}')
    assert outs == reference
    assert stats.parallel_steps >= 6 and stats.eplb_rebalances == stats.parallel_steps // 3
    assert len(stats.expert_balancedness) == 2 and all(0 < b <= 1 for b in stats.expert_balancedness)
    first = initial_placement(8, 2, 2)
    assert [p for p in placements] != [[list(first.rank_slots(r))] * 2 for r in range(2)]  # experts moved
    for rank in placements:  # 5 slots per rank; together they hold every expert
        assert all(len(layer) == 5 for layer in rank)
    for layer in range(2):
        assert set(placements[0][layer]) | set(placements[1][layer]) == set(range(8))
    assert stats.collectives["ep.all_reduce"][0] == stats.eplb_rebalances  # the window's counts, once each


def test_a_killed_rank_mid_generation_gives_a_clear_error_not_a_hang(moe_models, mixtral_ep2):
    """SIGKILL rank 1 while its peer waits in the expert all-to-all: the request fails naming rank 1, fast."""
    import threading
    import time

    from roofline import SamplingParams

    _, prompts, _ = moe_models["mixtral"]
    llm = mixtral_ep2
    llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)  # warm: the world works
    victim = llm.llm_engine.executor.ranks.by_rank(1).proc
    killer = threading.Timer(0.5, victim.kill)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        while time.monotonic() - t0 < 30:  # generating until the kill lands, mid-step or between steps
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    killer.join()
    assert time.monotonic() - t0 < 20
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.llm_engine.check_health()
