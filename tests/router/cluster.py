"""Test helpers: engines (AsyncLLM + the OpenAI server) and the router, each on a loopback port in this
process, on a tiny checkpoint; token ids read back through logprobs (the checkpoint has no tokenizer)."""

from __future__ import annotations

import json
import socket
import ssl
import time
from typing import Any, Optional

import httpx

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app
from roofline.metrics.prometheus import metric_value, parse_metrics
from roofline.router.app import RouterConfig, build_router_app

BLOCK = 8
# one TLS context for every client these helpers make (the URLs are plain http on loopback): a new
# httpx.Client otherwise loads the CA bundle again, 30 ms each, once per request here
_TLS = ssl.create_default_context()


def client(timeout: float) -> httpx.Client:
    return httpx.Client(timeout=timeout, verify=_TLS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(path: str, kv_transfer_config: Optional[dict] = None, num_kv_blocks: int = 96, port: int = 0,
                 **kw: Any) -> ServerThread:
    engine = AsyncLLM.from_engine_args(EngineArgs(model=path, device="cpu", dtype="float32", block_size=BLOCK,
                                                  num_kv_blocks=num_kv_blocks, kv_transfer_config=kv_transfer_config,
                                                  step_roofline=False, **kw))
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0)
    srv = ServerThread(build_app(engine, config), port=port, config=config).start()
    srv.engine = engine
    return srv


def start_router(**kw: Any) -> ServerThread:
    kw.setdefault("health_interval", 0.2)
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0)
    return ServerThread(build_router_app(RouterConfig(**kw)), config=config).start()


def stop(*servers: ServerThread) -> None:
    for s in servers:
        s.stop()
        engine = getattr(s, "engine", None)
        if engine is not None:
            engine.shutdown()


def completion(url: str, prompt: list[int], max_tokens: int, stream: bool = False, timeout: float = 60,
               **extra: Any) -> list[int]:
    """Greedy token ids of a completion (non-streamed or streamed) through the OpenAI API."""
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, stream=stream,
                **extra)
    with client(timeout) as c:
        if not stream:
            r = c.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return token_ids(r.json()["choices"][0]["logprobs"]["tokens"])
        tokens = []
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    if ch.get("logprobs"):
                        tokens += ch["logprobs"]["tokens"]
        return token_ids(tokens)


def token_ids(tokens: list[str]) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in tokens]


def metrics(url: str) -> dict[str, float]:
    with client(10) as c:
        r = c.get(url + "/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def wait_kv_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll an engine's /metrics until no request runs or waits and every KV block is back in the pool."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (metric_value(m, "roofline:num_requests_running") == 0
                and metric_value(m, "roofline:num_requests_waiting") == 0
                and metric_value(m, "roofline:kv_cache_usage_perc") == 0
                and metric_value(m, "roofline:kv_cache_num_free_blocks") == metric_value(m, "roofline:kv_cache_num_blocks"))
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_kv_idle(*servers: ServerThread, timeout: float = 30.0) -> None:
    for s in servers:
        m = wait_kv_idle(s.url, timeout)
        assert metric_value(m, "roofline:kv_cache_usage_perc") == 0, s.url
        assert metric_value(m, "roofline:kv_cache_num_free_blocks") == metric_value(m, "roofline:kv_cache_num_blocks")
        assert metric_value(m, "roofline:num_requests_running") == 0
        assert metric_value(m, "roofline:num_requests_waiting") == 0
