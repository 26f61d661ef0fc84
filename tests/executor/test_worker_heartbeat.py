"""Hung, stopped and killed tensor-parallel ranks are caught within seconds, mid-step or idle, and the
error names the rank that failed (not the peer that lost its connection to it)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from roofline import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def _tp2(path, **kw):
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, tensor_parallel_size=2, show_progress=False,
               **kw)


def _ranks(llm):
    return llm.llm_engine.executor.ranks


def test_a_rank_that_hangs_holding_the_gil_is_caught_by_its_heartbeat(tiny_models, monkeypatch):
    monkeypatch.setenv("ROOFLINE_HEARTBEAT_TIMEOUT", "2")
    from roofline.executor.multiproc import MultiprocExecutor

    path, _ = tiny_models["llama"]
    real_init = MultiprocExecutor.__init__
    monkeypatch.setattr(MultiprocExecutor, "__init__", lambda self, config, source, show_progress=True:
                        real_init(self, config, source, show_progress, worker_cls="tests.executor.tp_helpers:HangOnRank1Worker"))
    llm = _tp2(path)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) stopped responding: no heartbeat"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, use_tqdm=False)
    assert time.monotonic() - t0 < 20
    with pytest.raises(RuntimeError, match="rank 1"):
        llm.llm_engine.check_health()
    llm.llm_engine.shutdown()


def test_a_stopped_rank_is_caught_when_idle_and_mid_step(tiny_models):
    path, _ = tiny_models["llama"]
    llm = _tp2(path)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
    pid = _ranks(llm).by_rank(1).proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {pid}\) is stopped"):
            while time.monotonic() - t0 < 5:  # the server's idle loop calls it every second
                llm.llm_engine.check_health()
                time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
    llm.llm_engine.shutdown()


def test_killing_rank_0_blames_rank_0(tiny_models):
    path, _ = tiny_models["llama"]
    llm = _tp2(path)
    engine = llm.llm_engine
    # extreme seeds with n > 1 cross the msgpack link to the ranks (they used to break its encoder)
    seeded = SamplingParams(temperature=1.0, seed=2**63 - 1, n=2, max_tokens=3)
    assert len(llm.generate([{"prompt_token_ids": [5, 6]}], seeded, use_tqdm=False)[0].outputs) == 2
    engine.add_request("r", [5, 6, 7], PARAMS)
    engine.step()
    os.kill(_ranks(llm).by_rank(0).proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError) as err:
        for _ in range(100):
            engine.step()
    msg = str(err.value)
    assert msg.startswith("tensor-parallel worker rank 0"), msg
    assert "SIGKILL" in msg.split(";")[0]
    engine.shutdown()
