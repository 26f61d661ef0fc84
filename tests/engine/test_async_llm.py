"""AsyncLLM: the engine thread, request streams, aborts, errors, shutdown and stats.

Driven by a small fake EngineCore (same API, one token per request per step, no model) so the
threading behaviour is tested fast and deterministically; the real core is exercised through the
server tests in tests/entrypoints/.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from roofline.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineQueueFullError,
    RequestAbortedError,
)
from roofline.metrics.stats import IterationStats
from roofline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from roofline.sampling_params import RequestOutputKind, SamplingParams


class EngineOverloadedError(RuntimeError):
    """Same name as the core's exception, which AsyncLLM maps to EngineQueueFullError."""


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_total_blocks: int = 100
    num_free_blocks: int = 100
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


class _Req:
    def __init__(self, rid, prompt, params, arrival):
        self.rid, self.prompt, self.params = rid, prompt, params
        self.tokens: list[list[int]] = [[] for _ in range(params.n)]
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.sent = [0] * params.n


class FakeCore:
    """Token t of completion i of a request is (prompt[-1] + 1 + t + i) % 1000."""

    def __init__(self, max_model_len=20000, step_delay=0.002, max_waiting=None, fail_on_step=None):
        self.reqs: dict[str, _Req] = {}
        self.pending: list[RequestOutput] = []
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.max_waiting = max_waiting
        self.fail_on_step = fail_on_step
        self.num_steps = 0
        self.num_has_unfinished_calls = 0
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()
        self.tokenizer = None
        self.model_config = type("MC", (), {"max_model_len": max_model_len, "served_model_name": "fake",
                                            "model": None, "hf_config": None})()
        self.gen_tokens = 0
        self.prompt_tokens = 0

    def _touch(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt_token_ids, params, *, prompt=None, arrival_time=None, priority=0):
        self._touch()
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({self.max_model_len})")
        if self.max_waiting is not None and len(self.reqs) >= self.max_waiting:
            raise EngineOverloadedError("the waiting queue is full")
        self.reqs[request_id] = _Req(request_id, list(prompt_token_ids), params, arrival_time or time.monotonic())
        self.prompt_tokens += len(prompt_token_ids)

    def abort_requests(self, request_ids):
        self._touch()
        for rid in request_ids:
            r = self.reqs.pop(rid, None)
            if r is not None:
                self.aborted.append(rid)
                outs = [CompletionOutput(i, "", [], None, None, "abort") for i in range(r.params.n)]
                self.pending.append(RequestOutput(rid, None, r.prompt, None, outs, True, r.metrics))

    def has_unfinished_requests(self):
        self._touch()
        self.num_has_unfinished_calls += 1
        return bool(self.reqs) or bool(self.pending)

    def step(self):
        self._touch()
        self.num_steps += 1
        if self.fail_on_step is not None and self.num_steps >= self.fail_on_step:
            raise RuntimeError("simulated model failure")
        time.sleep(self.step_delay)
        outputs, self.pending = self.pending, []
        now = time.monotonic()
        for rid, r in list(self.reqs.items()):
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            outs = []
            for i, toks in enumerate(r.tokens):
                if len(toks) >= r.params.max_tokens:
                    continue
                toks.append((r.prompt[-1] + 1 + len(toks) + i) % 1000)
                self.gen_tokens += 1
                done = len(toks) >= r.params.max_tokens
                if r.params.output_kind == RequestOutputKind.DELTA:
                    new = toks[r.sent[i]:]
                    r.sent[i] = len(toks)
                else:
                    new = list(toks)
                outs.append(CompletionOutput(i, "".join(f"<{t}>" for t in new), new, None, None,
                                             "length" if done else None))
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            finished = all(len(t) >= r.params.max_tokens for t in r.tokens)
            if finished:
                del self.reqs[rid]
            outputs.append(RequestOutput(rid, None, r.prompt, None, outs, finished, r.metrics))
        return outputs

    def shutdown(self):
        self._touch()
        self.was_shut_down = True

    def get_stats(self):
        return FakeStats(num_running=len(self.reqs), prompt_tokens=self.prompt_tokens,
                         generation_tokens=self.gen_tokens)


class Recorder:
    def __init__(self):
        self.items: list[IterationStats] = []

    def record(self, stats):
        self.items.append(stats)


def params(max_tokens=5, n=1, kind=RequestOutputKind.DELTA):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, output_kind=kind)


def run(coro):
    return asyncio.run(coro)


def eventually(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


@pytest.fixture
def engine():
    core = FakeCore()
    rec = Recorder()
    eng = AsyncLLM(core, stat_loggers=[rec])
    yield eng
    eng.shutdown()


async def collect(eng, rid, prompt, p):
    outs = []
    async for out in eng.generate(prompt, p, rid):
        outs.append(out)
    return outs


def test_generate_streams_deltas_until_finished(engine):
    outs = run(collect(engine, "r1", [10], params(max_tokens=4)))
    assert [o.outputs[0].token_ids for o in outs] == [[11], [12], [13], [14]]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    # the core is only ever touched from the engine thread
    assert engine.core.thread_ids == {engine._thread.ident}


def test_cumulative_outputs_and_n(engine):
    outs = run(collect(engine, "r1", [10], params(max_tokens=3, n=2, kind=RequestOutputKind.CUMULATIVE)))
    last = outs[-1]
    assert last.finished
    assert sorted(c.index for c in last.outputs) == [0, 1]


def test_concurrent_requests_join_running_batch(engine):
    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", [i * 10], params(max_tokens=6)) for i in range(16)))

    results = run(main())
    for i, outs in enumerate(results):
        toks = [t for o in outs for t in o.outputs[0].token_ids]
        assert toks == [(i * 10 + 1 + k) % 1000 for k in range(6)]
    # batched: far fewer steps than 16 * 6
    assert engine.core.num_steps < 40


def test_invalid_request_raises_value_error_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await engine.add_request("bad", [1] * 20000, params(max_tokens=100))
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("bad2", [], params())
        return await collect(engine, "good", [1], params(max_tokens=2))

    outs = run(main())
    assert outs[-1].finished
    assert engine.is_healthy


def test_breaking_out_of_generate_aborts(engine):
    async def main():
        gen = engine.generate([1], params(max_tokens=100), "long")
        got = 0
        async for _ in gen:
            got += 1
            if got == 3:
                break
        await gen.aclose()
        for _ in range(200):
            if "long" in engine.core.aborted:
                break
            await asyncio.sleep(0.01)

    run(main())
    assert engine.core.aborted == ["long"]
    assert not engine.core.reqs


def test_cancelled_consumer_aborts(engine):
    async def main():
        task = asyncio.ensure_future(collect(engine, "c", [1], params(max_tokens=1000)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if "c" in engine.core.aborted:
                return
            await asyncio.sleep(0.01)

    run(main())
    assert "c" in engine.core.aborted


def test_queue_full_from_core_and_from_async_llm():
    core = FakeCore(max_waiting=1, step_delay=0.01)
    eng = AsyncLLM(core)
    try:
        async def main():
            s1 = await eng.add_request("a", [1], params(max_tokens=50))
            with pytest.raises(EngineQueueFullError) as info:
                await eng.add_request("b", [1], params(max_tokens=50))
            assert info.value.retry_after >= 1
            s1.close()

        run(main())
    finally:
        eng.shutdown()

    core = FakeCore(step_delay=0.0)
    eng = AsyncLLM(core, max_waiting_requests=0)
    try:
        async def main2():
            with pytest.raises(EngineQueueFullError, match="max-waiting-requests"):
                await eng.add_request("a", [1], params())

        run(main2())
    finally:
        eng.shutdown()


def test_idle_engine_blocks_instead_of_spinning(engine):
    run(collect(engine, "r", [1], params(max_tokens=2)))
    time.sleep(0.3)
    steps, calls = engine.core.num_steps, engine.core.num_has_unfinished_calls
    time.sleep(0.3)
    assert engine.core.num_steps == steps
    assert engine.core.num_has_unfinished_calls == calls


def test_engine_death_fails_inflight_and_turns_unhealthy():
    core = FakeCore(fail_on_step=5)
    eng = AsyncLLM(core)

    async def main():
        with pytest.raises(EngineDeadError, match="simulated model failure"):
            await collect(eng, "x", [1], params(max_tokens=100))
        with pytest.raises(EngineDeadError):
            await eng.add_request("y", [1], params())

    run(main())
    assert not eng.is_healthy
    assert isinstance(eng.dead_error, RuntimeError)
    eng.shutdown()


def test_shutdown_aborts_inflight_requests():
    core = FakeCore(step_delay=0.01)
    eng = AsyncLLM(core)

    async def main():
        stream = await eng.add_request("s", [1], params(max_tokens=10_000))
        await stream.__anext__()
        threading.Thread(target=eng.shutdown).start()
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("t", [1], params())

    run(main())
    eng._thread.join(10)
    assert "s" in core.aborted
    assert not eng.is_healthy
    assert core.was_shut_down  # the core (and its executor) is released from the engine thread
    assert core.thread_ids == {eng._thread.ident}


def test_stats_record_ttft_itl_and_finished(engine):
    run(collect(engine, "m", [1], params(max_tokens=5)))
    rec = engine.stat_loggers[0]
    assert eventually(lambda: any(it.finished for it in rec.items))
    ttfts = [v for it in rec.items for v in it.ttfts]
    itls = [v for it in rec.items for v in it.itls]
    finished = [f for it in rec.items for f in it.finished]
    assert len(ttfts) == 1 and ttfts[0] >= 0
    assert len(itls) == 4 and all(v >= 0 for v in itls)
    assert len(finished) == 1
    f = finished[0]
    assert f.finish_reason == "length" and f.num_generation_tokens == 5 and f.num_prompt_tokens == 1
    assert f.e2e_latency >= f.ttft >= 0
    assert engine.get_stats().num_running == 0


def test_aborted_request_counts_as_abort(engine):
    async def main():
        stream = await engine.add_request("a", [1], params(max_tokens=1000))
        await stream.__anext__()
        stream.close()
        for _ in range(200):
            if "a" in engine.core.aborted:
                return
            await asyncio.sleep(0.01)

    run(main())
    rec = engine.stat_loggers[0]
    assert eventually(lambda: any(it.finished for it in rec.items))
    reasons = [f.finish_reason for it in rec.items for f in it.finished]
    assert reasons == ["abort"]


def test_idle_engine_notices_dead_workers():
    """A worker (tensor-parallel rank) that dies while nothing runs turns the engine unhealthy."""
    core = FakeCore()
    broken = {"now": False}

    def check_health():
        if broken["now"]:
            raise RuntimeError("tensor-parallel worker rank 1 died")

    core.check_health = check_health
    eng = AsyncLLM(core)
    eng.idle_health_interval = 0.05
    run(collect(eng, "r", [1], params(max_tokens=2)))
    assert eng.is_healthy
    broken["now"] = True
    deadline = time.monotonic() + 5
    while eng.is_healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not eng.is_healthy
    assert "rank 1" in str(eng.dead_error)
    eng.shutdown()
