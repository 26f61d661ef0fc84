"""The engine core in a process of its own (EngineCoreClient): the same greedy tokens as the core in
this process, refusals with the core's own error, aborts, every KV block back, and a core process
that dies turns the engine dead with a clear error instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM, EngineDeadError
from roofline.engine.core_process import EngineCoreClient, EngineCoreDeadError
from roofline.engine.engine_core import EngineOverloadedError
from roofline.sampling_params import RequestOutputKind, SamplingParams
from tests.reference.hf_models import hf_greedy, random_prompts


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models["llama"]


def _args(path, **kw) -> EngineArgs:
    return EngineArgs(model=path, device="cpu", dtype="float32", num_kv_blocks=64, **kw)


async def _collect(engine, prompts, params):
    async def one(i, p):
        last = None
        async for out in engine.generate(p, params, f"r{i}"):
            last = out
        return last

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def test_same_greedy_tokens_as_hf_and_blocks_back(llama):
    path, hf = llama
    engine = AsyncLLM.from_engine_args(_args(path, engine_core_process=True))
    try:
        assert isinstance(engine.core, EngineCoreClient)
        assert engine.core.proc.pid != os.getpid()
        assert engine.model_config.max_model_len == 512 and engine.model_config.hf_config.vocab_size == 384
        prompts = random_prompts(6, 384, 3, 40, seed=3)
        outs = asyncio.run(_collect(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
        for p, out in zip(prompts, outs):
            assert out.finished and out.outputs[0].token_ids == hf_greedy(hf, p, 12)
        deadline = time.monotonic() + 10
        while True:  # the stats of the core's last step arrive with (or just after) the last output
            stats = engine.get_stats()
            if stats.num_running == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
        assert stats.generation_tokens == 6 * 12
    finally:
        engine.shutdown()
    assert engine.core.proc.poll() is not None  # the core process is gone after shutdown


def test_refusals_come_back_with_the_cores_error_type(llama):
    path, _ = llama
    client = EngineCoreClient(_args(path, max_waiting_requests=1, max_num_seqs=1).create_engine_config())
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            client.add_request("long", [5] * 600, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="out of range"):
            client.add_request("bad", [5, 10_000], SamplingParams(max_tokens=4))
        client.add_request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            client.add_request("a", [5, 6], SamplingParams(max_tokens=2))
        # parameters that validated here but not in the core (changed after construction): that request
        # alone is refused, the core keeps serving
        beams = SamplingParams(n=2, use_beam_search=True, max_tokens=2)
        beams.stop_token_ids = [3]
        with pytest.raises(ValueError, match="not supported with use_beam_search"):
            client.add_request("mutated", [5, 6], beams)
        # an abort is answered on the next step with the request's final output
        client.abort_requests(["a"])
        finished = []
        while client.has_unfinished_requests():
            finished += [o for o in client.step() if o.finished]
        assert [o.request_id for o in finished] == ["a"]
        assert finished[0].outputs[0].finish_reason == "abort"
        stats = client.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        # the waiting queue limit is the core's: one request runs (max_num_seqs=1), one waits
        client.add_request("b", [5, 6, 7], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        while not any(o.request_id == "b" for o in client.step()):  # b is running (it has a token), not waiting
            pass
        client.add_request("w1", [5, 6], SamplingParams(max_tokens=2))
        with pytest.raises(EngineOverloadedError):
            client.add_request("w2", [5, 6], SamplingParams(max_tokens=2))
    finally:
        client.shutdown()


def test_start_up_errors_keep_their_type(tmp_path):
    with pytest.raises((ValueError, FileNotFoundError, RuntimeError), match="nothing-here"):
        EngineCoreClient(_args(str(tmp_path / "nothing-here")).create_engine_config())


def test_a_core_process_that_dies_fails_every_request_without_hanging(llama):
    path, _ = llama
    engine = AsyncLLM.from_engine_args(_args(path, engine_core_process=True))
    try:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

        async def run():
            got = 0
            with pytest.raises(EngineDeadError, match="engine core process .* was killed by SIGKILL"):
                async for _ in engine.generate([5, 6, 7], params, "victim"):
                    got += 1
                    if got == 3:
                        os.kill(engine.core.proc.pid, signal.SIGKILL)
            return got

        t0 = time.monotonic()
        assert asyncio.run(asyncio.wait_for(run(), 30)) >= 3
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 10
        while engine.is_healthy and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.is_healthy
        assert isinstance(engine.dead_error, EngineCoreDeadError)
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.add_request("late", [5], SamplingParams(max_tokens=1)))
    finally:
        engine.shutdown()
