"""The router end to end, engines in this process on a tiny checkpoint: PD (one prefill and one decode
engine, SharedStorageConnector) and data-parallel replicas give HF's greedy tokens, streamed or not;
the router's /health and /metrics follow an engine going down and coming back."""

from __future__ import annotations

import time

import httpx
import pytest

from roofline.metrics.prometheus import metric_value, parse_metrics
from tests.reference.hf_models import hf_greedy
from tests.router.cluster import assert_kv_idle, completion, free_port, metrics, start_engine, start_router, stop

MAX_TOKENS = 8
PROMPT_LENS = (3, 8, 17, 30)


def prompts() -> list[list[int]]:
    return [[(11 * i + 5 * n) % 370 + 7 for i in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def plain(tiny):
    """Two plain engines on the tiny model, shared by the tests below (each builds its own router, whose
    counters start at zero): the colocated reference, the replicas, the live replica of the health test."""
    path, _ = tiny
    engines = [start_engine(path), start_engine(path)]
    yield engines
    stop(*engines)


def storage(role: str, path: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": path}}


def test_pd_through_router_matches_hf_and_colocated(tiny, plain, tmp_path):
    path, hf = tiny
    store = str(tmp_path / "kv")
    prefill = start_engine(path, storage("kv_producer", store))
    decode = start_engine(path, storage("kv_consumer", store), engine_core_process=True)  # the core elsewhere
    colocated = plain[0]
    router = start_router(prefill=[prefill.url], decode=[decode.url])
    try:
        for p in prompts():
            expected = hf_greedy(hf, p, MAX_TOKENS)
            assert completion(colocated.url, p, MAX_TOKENS) == expected
            assert completion(router.url, p, MAX_TOKENS) == expected
            assert completion(router.url, p, MAX_TOKENS, stream=True) == expected
        # the decode engine loaded every full block but the last prompt token's from the prefill's files
        m = metrics(decode.url)
        assert metric_value(m, "roofline:kv_transfer_received_bytes_total") > 0
        assert metric_value(m, "roofline:prompt_tokens_total") == 2 * sum(PROMPT_LENS)
        assert_kv_idle(prefill, decode, colocated)
        rm = parse_metrics(httpx.get(router.url + "/metrics").text)
        assert metric_value(rm, "roofline_router:backend_requests_total", role="prefill") == 2 * len(PROMPT_LENS)
        assert metric_value(rm, "roofline_router:backend_requests_total", role="decode") == 2 * len(PROMPT_LENS)
        assert metric_value(rm, "roofline_router:backend_in_flight") == 0
    finally:
        stop(router, prefill, decode)


def test_replicas_round_robin_match_hf(tiny, plain):
    _, hf = tiny
    replicas = plain
    router = start_router(replicas=[r.url for r in replicas])
    try:
        for p in prompts():
            expected = hf_greedy(hf, p, MAX_TOKENS)
            assert completion(router.url, p, MAX_TOKENS) == expected
            assert completion(router.url, p, MAX_TOKENS, stream=True) == expected
        rm = parse_metrics(httpx.get(router.url + "/metrics").text)
        for r in replicas:  # round robin: each served half
            assert metric_value(rm, "roofline_router:backend_requests_total", backend=r.url) == len(PROMPT_LENS)
        assert_kv_idle(*replicas)
    finally:
        stop(router)


def test_health_takes_a_dead_replica_out_and_brings_it_back(tiny, plain):
    path, hf = tiny
    live = plain[0]
    dead_port = free_port()
    dead_url = f"http://127.0.0.1:{dead_port}"
    router = start_router(replicas=[dead_url, live.url])
    revived = None
    try:
        h = httpx.get(router.url + "/health")
        assert h.status_code == 200  # one replica is enough
        # counts only on the open route: no engine URL, no connection error text
        assert h.json() == {"status": "ok", "engines": {"replica": {"healthy": 1, "total": 2}}}
        p = prompts()[1]
        expected = hf_greedy(hf, p, MAX_TOKENS)
        for _ in range(3):  # every request lands on the live one
            assert completion(router.url, p, MAX_TOKENS) == expected
        rm = parse_metrics(httpx.get(router.url + "/metrics").text)
        assert metric_value(rm, "roofline_router:backend_healthy", backend=dead_url) == 0
        assert metric_value(rm, "roofline_router:backend_healthy", backend=live.url) == 1
        assert metric_value(rm, "roofline_router:backend_requests_total", backend=live.url) == 3
        # the dead one comes up: the health loop brings it back into rotation
        revived = start_engine(path, port=dead_port)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rm = parse_metrics(httpx.get(router.url + "/metrics").text)
            if metric_value(rm, "roofline_router:backend_healthy", backend=dead_url) == 1:
                break
            time.sleep(0.05)
        for _ in range(2):
            assert completion(router.url, p, MAX_TOKENS) == expected
        rm = parse_metrics(httpx.get(router.url + "/metrics").text)
        assert metric_value(rm, "roofline_router:backend_requests_total", backend=live.url) == 4
        assert metric_value(rm, "roofline_router:backend_requests_total", backend=dead_url) >= 1
        assert_kv_idle(live, revived)
    finally:
        stop(*(s for s in (router, revived) if s is not None))


def test_router_health_fails_without_engines_and_rejects_bad_bodies(tiny):
    router = start_router(prefill=[f"http://127.0.0.1:{free_port()}"], decode=[f"http://127.0.0.1:{free_port()}"])
    try:
        deadline = time.monotonic() + 5
        while httpx.get(router.url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        h = httpx.get(router.url + "/health")
        assert h.status_code == 503 and "127.0.0.1" not in h.text and "Error" not in h.text
        assert h.json()["engines"] == {"prefill": {"healthy": 0, "total": 1}, "decode": {"healthy": 0, "total": 1}}
        r = httpx.post(router.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and "no healthy prefill engine" in r.json()["error"]["message"]
        r = httpx.post(router.url + "/v1/completions", json={"prompt": [1, 2, 3], "n": 2})
        assert r.status_code == 400 and "n must be 1" in r.json()["error"]["message"]
        r = httpx.post(router.url + "/v1/completions", content=b"[1]", headers={"content-type": "application/json"})
        assert r.status_code == 400
    finally:
        stop(router)


def test_an_engine_failure_tells_the_client_an_id_and_the_log_the_details(caplog):
    from roofline.router.app import upstream_failure
    from roofline.router.backends import Backend

    b = Backend(url="http://10.1.2.3:8123", role="decode")
    msg = upstream_failure("decode", b, ConnectionResetError("peer gone, gloo: ::ffff:10.1.2.3"), "failed mid-answer")
    assert msg.startswith("the decode engine failed mid-answer (error err-") and "10.1.2.3" not in msg
    ref = msg.split("(error ")[1].split(")")[0]
    assert any(ref in r.getMessage() and "10.1.2.3:8123" in r.getMessage() and "gloo" in r.getMessage()
               for r in caplog.records)
