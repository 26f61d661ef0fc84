"""Shutdown drains: new requests get 503 (and /health says draining) while in-flight ones keep going;
a request that finishes within shutdown_timeout completes normally, one still running then ends with an
error event and [DONE]; every KV block is back."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app


# enough decode steps of the tiny model to outlast the 2 s drain also when the engine core runs in a
# process of its own (free of the server's GIL it does 500 tokens in ~0.3 s)
LONG = 16


@pytest.fixture(scope="module")
def engine(tiny_models):
    """One engine on the tiny model for both tests, each with a server of its own on it (the server stops,
    the engine stays): one request at a time, so that queued requests outlast the first test's drain."""
    path, _ = tiny_models["llama"]
    eng = AsyncLLM.from_engine_args(EngineArgs(model=path, device="cpu", dtype="float32", num_kv_blocks=64,
                                               max_num_seqs=1))
    yield eng
    eng.shutdown()


def test_shutdown_drains_then_ends_streams_cleanly(engine):
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0)
    srv = ServerThread(build_app(engine, config, shutdown_engine=False), config=config).start()
    long_body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True}
    events, plain = [], []

    def one_long():  # LONG of these run one at a time (max_num_seqs=1): seconds of work, past the drain
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            plain.append(c.post("/v1/completions", json=long_body).status_code)

    def stream():  # queued behind them: still waiting when the drain time is up
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

    def wait_in_flight(n):
        deadline = time.monotonic() + 30
        while engine.num_in_flight() < n:
            assert time.monotonic() < deadline
            time.sleep(0.01)

    threads = [threading.Thread(target=one_long) for _ in range(LONG)]
    for t in threads:
        t.start()
    wait_in_flight(LONG)
    threads.append(threading.Thread(target=stream))  # last in the queue
    threads[-1].start()
    wait_in_flight(LONG + 1)
    stopper = threading.Thread(target=srv.stop)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        stopper.start()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the drain has begun once /health says so
            h = c.get("/health")
            if h.status_code == 503:
                break
            time.sleep(0.02)
        assert h.status_code == 503 and h.json()["status"] == "draining"
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    for t in threads:
        t.join(30)
    stopper.join(30)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "shutting down" in err["message"]
    assert 503 in plain  # the ones still running or waiting were aborted, not cut
    assert set(plain) <= {200, 503}
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_a_request_that_finishes_within_the_drain_completes(engine):
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=20.0)
    srv = ServerThread(build_app(engine, config, shutdown_engine=False), config=config).start()
    result = {}

    def request():
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            result["r"] = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True})

    t = threading.Thread(target=request)
    t.start()
    deadline = time.monotonic() + 30
    while engine.num_in_flight() == 0:  # the request is in the engine before the drain begins
        assert time.monotonic() < deadline
        time.sleep(0.01)
    srv.stop()
    t.join(30)
    r = result["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 200
