"""When the engine thread dies, /health turns 503 and in-flight requests get an OpenAI-shaped error.

Uses a minimal fake core (no model) that generates a few tokens and then raises inside step().
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app
from roofline.outputs import CompletionOutput, RequestMetrics, RequestOutput
from roofline.sampling_params import RequestOutputKind


class CrashingCore:
    tokenizer = None

    def __init__(self):
        self.model_config = type("MC", (), {"max_model_len": 64, "served_model_name": "crashy", "model": "crashy",
                                            "hf_config": None})()
        self.reqs = {}
        self.crash = threading.Event()

    def add_request(self, request_id, prompt_token_ids, params, *, prompt=None, arrival_time=None, priority=0):
        assert params.output_kind == RequestOutputKind.DELTA
        self.reqs[request_id] = (list(prompt_token_ids), params, RequestMetrics(arrival_time or time.monotonic()), [0])

    def abort_requests(self, ids):
        for i in ids:
            self.reqs.pop(i, None)

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        time.sleep(0.01)
        if self.crash.is_set():
            raise RuntimeError("CUDA error: device-side assert (simulated)")
        outs = []
        for rid, (prompt, params, metrics, count) in list(self.reqs.items()):
            count[0] += 1
            done = count[0] >= params.max_tokens
            outs.append(RequestOutput(rid, None, prompt, None, [
                CompletionOutput(0, f"t{count[0]} ", [count[0]], None, None, "length" if done else None)],
                done, metrics))
            if done:
                del self.reqs[rid]
        return outs

    def get_stats(self):
        return None


@pytest.fixture
def crashy():
    core = CrashingCore()
    engine = AsyncLLM(core)
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0)
    srv = ServerThread(build_app(engine, config), config=config).start()
    yield srv, core, engine
    srv.stop()
    engine.shutdown()


def test_engine_death_turns_health_red_and_fails_inflight(crashy, caplog):
    srv, core, engine = crashy
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t1 t2 t3 "
        # an in-flight non-streaming request, and an in-flight stream
        result = {}
        t = threading.Thread(target=lambda: result.update(
            r=c.post("/v1/completions", json={"prompt": [1], "max_tokens": 60})))
        t.start()
        events = []
        with c.stream("POST", "/v1/completions", json={"prompt": [1], "max_tokens": 60, "stream": True}) as s:
            for line in s.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    core.crash.set()
        t.join(30)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        # a short error with the request id; what died and how (here "simulated") only in the log
        assert re.fullmatch(r"the engine has stopped \(request cmpl-\w+\); the server log has the details",
                            err["message"]), err
        assert result["r"].status_code == 503  # a dead engine is unavailable, not an internal error
        full = result["r"].json()["error"]["message"]
        assert "stopped" in full and "simulated" not in full and "died" not in full
        logged = "\n".join(r.getMessage() for r in caplog.records)
        ref = re.search(r"request (cmpl-\w+)", err["message"]).group(1)
        assert re.search(ref + r".*engine loop died.*simulated", logged), logged

        h = c.get("/health")
        assert h.status_code == 503 and h.json() == {"status": "unhealthy", "error": "the engine has stopped"}
        r = c.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and "error" in r.json()
    assert not engine.is_healthy
