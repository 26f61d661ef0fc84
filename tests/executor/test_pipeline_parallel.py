"""Pipeline parallelism end to end on CPU with gloo: stages of layers in their own processes.

Greedy tokens identical to HF at pp=2 and pp=3 (with pp batches in flight) (even split and
--pp-layer-partition), at tp=2 x pp=2, and for a tiny MoE model at pp=2; the default SmolLM2 (30 layers,
GGUF) at pp=3 identical to one process, with grammar-constrained rows; each stage's KV pool holds only its
layers; every KV block is back after the run; a stage that dies fails
the in-flight requests with an error naming it, without a hang."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from roofline import LLM, SamplingParams
from roofline.config import EngineArgs
from roofline.sampling_params import StructuredOutputsParams
from tests.executor.tp_helpers import assert_same_greedy, chat_prompts, kill_rank_mid_generation
from tests.reference.hf_models import build_tiny_model, hf_greedy, random_prompts

COMMON = dict(dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
MAX_NEW = 10


def _greedy_matches_hf(llm: LLM, hf, vocab: int, n: int = 4) -> None:
    prompts = random_prompts(n, vocab, 3, 40, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, MAX_NEW), p
    stats = llm.llm_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """A tiny Llama with 4 layers (stages of 2+2, 1+2+1, ...)."""
    path = str(tmp_path_factory.mktemp("llama4"))
    return path, build_tiny_model("llama", path, seed=4, num_hidden_layers=4)


@pytest.fixture(scope="module")
def llama4_pp2(llama4):
    """The tiny Llama at pp=2 (2+2 layers), shared by the even-split check and the batches-in-flight test."""
    llm = LLM(llama4[0], pipeline_parallel_size=2, **COMMON)
    yield llm
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("pp, partition, layers", [
    (2, None, [2, 2]),
    (3, None, [1, 2, 1]),  # the remainder goes to the stages before the last
    (3, "2,1,1", [2, 1, 1]),
])
def test_greedy_matches_hf(llama4, pp, partition, layers, request):
    path, hf = llama4
    shared = pp == 2 and partition is None
    llm = request.getfixturevalue("llama4_pp2") if shared else LLM(path, pipeline_parallel_size=pp,
                                                                     pp_layer_partition=partition, **COMMON)
    try:
        _greedy_matches_hf(llm, hf, 384)
        # each stage's pool holds its own layers' K/V only: rank 0's block is its layers' share
        one_layer = LLM(path, **COMMON).llm_engine.executor.block_bytes() // 4
        assert llm.llm_engine.executor.block_bytes() == layers[0] * one_layer
    finally:
        if not shared:
            llm.llm_engine.shutdown()


def test_batches_in_flight_fill_the_pipeline(llama4, llama4_pp2, monkeypatch):
    """pp=2 keeps two steps in the pipeline when it has two disjoint batches of requests; the output
    is still HF's, and the stages' busy-time accounting comes back from every rank."""
    _, hf = llama4
    llm = llama4_pp2
    ex = llm.llm_engine.executor
    depths = []
    submit = ex.submit

    def recording_submit(out):
        submit(out)
        depths.append(len(ex._submitted))

    monkeypatch.setattr(ex, "submit", recording_submit)
    assert ex.max_batches_in_flight == 2
    ex.reset_stage_busy()
    _greedy_matches_hf(llm, hf, 384, n=6)
    assert max(depths) == 2
    busy = ex.stage_busy()
    assert len(busy) == 2 and all(0 < b <= w for b, w in busy)
    assert not llm.llm_engine.scheduler.in_flight


@pytest.mark.parametrize("arch, seed, overrides", [
    # the last stage holds the LM head without the embedding it is tied to: it loads the embedding's tensor
    ("qwen3", 5, {"tie_word_embeddings": True}),
    # a mixture of experts: 6 layers, the sparse ones at 1 and 5 (one per stage)
    ("qwen2_moe", 3, {}),
])
def test_pp2_greedy_matches_hf(tmp_path, arch, seed, overrides):
    path = str(tmp_path / arch)
    hf = build_tiny_model(arch, path, seed=seed, **overrides)
    llm = LLM(path, pipeline_parallel_size=2, **COMMON)
    try:
        _greedy_matches_hf(llm, hf, 384, n=3)
    finally:
        llm.llm_engine.shutdown()


def test_bad_partitions_are_refused_naming_the_flag(llama4):
    path, _ = llama4
    with pytest.raises(ValueError, match="pp_layer_partition .* 3 entries for pipeline_parallel_size=2"):
        EngineArgs(model=path, pipeline_parallel_size=2, pp_layer_partition="1,1,2").create_engine_config()
    with pytest.raises(ValueError, match="at least one layer"):
        EngineArgs(model=path, pipeline_parallel_size=2, pp_layer_partition="4,0").create_engine_config()
    with pytest.raises(ValueError, match="pp_layer_partition 3,2 must give 2 stages 4 layers"):
        LLM(path, pipeline_parallel_size=2, pp_layer_partition="3,2", **COMMON)


def test_a_stage_that_dies_fails_requests_without_hanging(llama4):
    from roofline.engine.async_llm import AsyncLLM
    from roofline.engine.engine_core import EngineCore

    path, _ = llama4
    core = EngineCore(EngineArgs(model=path, pipeline_parallel_size=2, dtype="float32", device="cpu",
                                 num_kv_blocks=64, max_model_len=512).create_engine_config(), show_progress=False)
    ranks = core.executor.ranks
    engine = AsyncLLM(core)
    try:
        elapsed, errors = asyncio.run(kill_rank_mid_generation(engine, ranks, 1))  # the last stage
        assert elapsed < 15, elapsed
        assert all("rank 1" in e for e in errors), errors
        assert not engine.is_healthy
        deadline = time.monotonic() + 15
        while ranks.by_rank(0).proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ranks.by_rank(0).proc.poll() is not None  # the first stage was stopped too
    finally:
        engine.shutdown()
        core.shutdown()


def test_tp2_pp2_greedy_matches_hf(llama4):
    """Two stages of two tensor-parallel ranks each (four processes): greedy tokens identical to HF; each
    rank's pool holds its stage's layers."""
    path, hf = llama4
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **COMMON)
    try:
        _greedy_matches_hf(llm, hf, 384)
        one_layer = LLM(path, **COMMON).llm_engine.executor.block_bytes() // 4
        assert llm.llm_engine.executor.block_bytes() == one_layer  # 2 layers x half of the 2 KV heads
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_smollm2_stages_match_one_process(default_llm):
    """The default model's 30 layers (GGUF) in three stages of 10: greedy tokens identical to one process
    (a flip only at a proven tie); grammar-constrained rows match their regex (the step's bitmask reaches
    the last stage inside the SchedulerOutput; test_spec_decode's tp=3 run checks it over TP ranks)."""
    prompts = chat_prompts(default_llm.get_tokenizer())
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = default_llm.generate(prompts, sp, use_tqdm=False)
    llm = LLM(pipeline_parallel_size=3, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False)
    try:
        assert llm.llm_engine.model_config.hf_config.num_hidden_layers == 30
        assert_same_greedy(ref, llm.generate(prompts, sp, use_tqdm=False))
        regex = "[A-Z][a-z]{1,8} [0-9]{2}"
        constrained = SamplingParams(temperature=0, max_tokens=16,
                                     structured_outputs=StructuredOutputsParams(regex=regex))
        outs = llm.generate(prompts, [constrained, sp, constrained], use_tqdm=False)
        texts = [outs[i].outputs[0].text for i in (0, 2)]
        assert all(re.fullmatch(regex, t) for t in texts), texts
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.llm_engine.shutdown()
