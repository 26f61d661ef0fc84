"""The server as a hostile client finds it: every malformed or adversarial request is a 4xx naming the
problem, never a 500 and never the end of the engine; afterwards /health is 200 and every KV block is
back.  A property test throws random bodies at both generation routes, and a fuzzer driven by the
server's OpenAPI document throws schema-shaped bodies at every POST route; idle and slowloris
connections time out without holding anyone up."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app
from roofline.metrics.prometheus import metric_value, parse_metrics
from tests.reference.openapi_strategies import from_openapi_schema

API_KEY = "sk-hostile"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLM.from_engine_args(EngineArgs(model=None, device="cpu", dtype="float32",
                                                  max_model_len=MAX_MODEL_LEN, max_num_seqs=8, seed=0))
    config = ServerConfig(api_key=API_KEY, max_request_body_bytes=4 << 20, request_body_timeout=1.0,
                          uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0)
    srv = ServerThread(build_app(engine, config), config=config).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def raw(http, path, body: bytes, content_type="application/json"):
    return http.post(path, content=body, headers={"Content-Type": content_type})


def assert_idle_and_healthy(http, timeout=30.0):
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(http.get("/metrics").text)
        if (metric_value(m, "roofline:num_requests_running") == 0
                and metric_value(m, "roofline:kv_cache_num_free_blocks") == metric_value(m, "roofline:kv_cache_num_blocks")):
            return
        assert time.monotonic() < deadline, "KV blocks not back"
        time.sleep(0.05)


SELF_REQUIRING = {"$ref": "#", "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMP = {"prompt": "hi", "max_tokens": 2}

# (route, raw body, expected status, a word the message names)
HOSTILE = [
    ("/v1/completions", json.dumps({**COMP, "seed": 10**30}), 400, "seed"),
    ("/v1/completions", json.dumps({**COMP, "seed": 10**20}), 400, "seed"),
    ("/v1/completions", json.dumps({**COMP, "seed": 2**64 - 1, "n": 2}), 400, "seed"),
    ("/v1/completions", json.dumps({**COMP, "seed": True}), 400, "seed"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400, "NaN"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": NaN}', 400, "NaN"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}', 400, "range"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "top_p": -Infinity}', 400, "Infinity"),
    ("/v1/completions", json.dumps({**COMP, "max_tokens": True}), 400, "max_tokens"),
    ("/v1/completions", json.dumps({**COMP, "stream": "yes"}), 400, "stream"),
    ("/v1/completions", json.dumps({**COMP, "n": 2.0}), 400, "n"),
    ("/v1/completions", json.dumps({"prompt": "a\ud800b", "max_tokens": 2}), 400, "surrogate"),
    ("/v1/completions", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, "nests"),
    ("/v1/completions", '{"prompt": ' + "[" * 40 + "1" + "]" * 40 + "}", 400, "nests"),
    ("/v1/completions", "[1, 2]", 400, "object"),
    ("/v1/completions", "{", 400, "JSON"),
    ("/v1/completions", json.dumps({**COMP, "logprobs": 1000}), 400, "logprobs"),
    ("/v1/completions", json.dumps({"prompt": [10**12], "max_tokens": 2}), 400, "range"),
    ("/v1/completions", json.dumps({"prompt": "x " * 200000, "max_tokens": 2}), 400, "max_model_len"),
    ("/v1/chat/completions", json.dumps({**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}), 400, "role"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "a\udfffb"}]}), 400, "surrogate"),
    ("/v1/chat/completions", json.dumps({**CHAT, "chat_template": "{{ 'hello ' * 10000000 }}"}), 400,
     "chat_template"),
    ("/v1/chat/completions", json.dumps({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}),
     400, "tool"),
    ("/v1/chat/completions", json.dumps({**CHAT, "tool_choice": "required"}), 400, "tool"),
    ("/v1/chat/completions", json.dumps({**CHAT, "functions": [{"name": "f"}]}), 400, "function"),
    ("/v1/chat/completions", json.dumps({**CHAT, "temperature": "hot"}), 400, "temperature"),
    ("/v1/chat/completions", json.dumps({**CHAT, "seed": -(2**63) - 1}), 400, "seed"),
    # constraints no text matches (400 at compile time: xgrammar refuses the schema whose only content is itself,
    # the engine finds the regex's dead end), and one that reaches a dead end after "aa"
    ("/v1/completions", json.dumps({**COMP, "structured_outputs": {"json": SELF_REQUIRING}}), 400, "circular $ref"),
    ("/v1/completions", json.dumps({**COMP, "guided_regex": "[^\\s\\S]"}), 400, "never produce"),
    ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 8, "temperature": 0, "guided_regex": "aa[^\\s\\S]"}),
     400, "allows no token after"),
    # integers past 64 bits, wherever they are
    ("/v1/completions", json.dumps({"prompt": [2**70], "max_tokens": 2}), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": [[1, 2], [-1]], "max_tokens": 2}), 400, "prompt"),
    ("/v1/completions", json.dumps({**COMP, "priority": 2**70}), 400, "priority"),
    ("/v1/completions", json.dumps({**COMP, "stop_token_ids": [-(2**70)]}), 400, "stop_token_ids"),
    ("/v1/completions", json.dumps({**COMP, "max_tokens": 2**64}), 400, "max_tokens"),
    ("/v1/chat/completions", json.dumps({**CHAT, "n": 2**70}), 400, "'n'"),
    ("/v1/chat/completions", json.dumps({**CHAT, "min_tokens": -(2**65)}), 400, "min_tokens"),
    ("/detokenize", json.dumps({"tokens": [2**70]}), 400, "tokens"),
    ("/v1/completions", json.dumps({**COMP, "kv_transfer_params": {"do_remote_decode": True, "x": 2**70}}), 400,
     "kv_transfer_params"),
    ("/v1/completions", json.dumps({**COMP, "guided_json": {"type": "integer", "maximum": 2**70}}), 400, "guided_json"),
    ("/v1/completions", json.dumps({**COMP, "structured_outputs": {"json": True}, "kv_transfer_params": {"x": 2**70}}),
     400, "kv_transfer_params"),
    # beam search with a constraint (the fuzzer found it killing the core process)
    ("/v1/completions", json.dumps({**COMP, "use_beam_search": True, "n": 2, "guided_choice": ["a", "b"]}), 400,
     "use_beam_search"),
    # bounded work per request
    ("/v1/completions", json.dumps({**COMP, "prompt": ["a"] * 5000}), 400, "too many prompts"),
    ("/v1/completions", json.dumps({**COMP, "prompt": ["a"] * 300, "n": 100}), 400, "too many completions"),
]


@pytest.mark.parametrize("route,body,status,word", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_body_is_a_clear_4xx(http, route, body, status, word):
    r = raw(http, route, body.encode("utf-8", "surrogatepass"))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert word.lower() in json.dumps(err).lower(), err
    assert http.get("/health").status_code == 200


def test_wrong_encodings_and_media_types(http):
    body = json.dumps(COMP)
    assert raw(http, "/v1/completions", body.encode("utf-16")).status_code == 400
    r = raw(http, "/v1/completions", body.encode(), content_type="text/plain")
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert raw(http, "/v1/completions", body.encode(), content_type="application/json; charset=utf-8").status_code == 200
    assert_idle_and_healthy(http)


def test_extreme_valid_seeds_are_served(http):
    for seed in (2**63 - 1, -(2**63)):
        r = http.post("/v1/completions", json={**COMP, "seed": seed, "n": 2, "temperature": 1.0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
    assert_idle_and_healthy(http)


def test_api_key_covers_every_route_but_health(server, http):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert anon.get("/health").status_code == 200
        for method, path in [("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/v1/models"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/completions")]:
            r = anon.request(method, path, json={})
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert http.get("/openapi.json").status_code == 200


def test_a_body_that_never_arrives_times_out(server):
    host, port = server.host, server.port
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        reply = s.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408"), reply[:80]
        assert time.monotonic() - t0 < 8


def test_health_answers_while_a_huge_text_is_tokenized(http):
    text = "hello world, this is some text " * 100000  # 3.1 MB: seconds of tokenizing
    done = threading.Event()
    result = {}

    def tokenize():
        result["r"] = http.post("/tokenize", json={"prompt": text})
        done.set()

    threading.Thread(target=tokenize, daemon=True).start()
    answered_during = 0
    while not done.wait(0.05):
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        assert time.monotonic() - t0 < 2.0  # the event loop is free (the figure, ~ms, is in the closing note)
        answered_during += 1
    assert result["r"].status_code == 200 and result["r"].json()["count"] > 100000
    assert answered_during >= 3


def test_continuous_usage_stats(http):
    events = []
    with http.stream("POST", "/v1/completions", json={**COMP, "max_tokens": 5, "ignore_eos": True, "stream": True,
                                                      "stream_options": {"continuous_usage_stats": True}}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    usage = [e["usage"] for e in events if e.get("choices")]
    assert usage and all(u is not None for u in usage)
    completion = [u["completion_tokens"] for u in usage]
    assert completion == sorted(completion) and completion[-1] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usage)


def test_a_dead_end_mid_stream_is_an_error_event(http):
    """A constraint that allows nothing after "aa": the stream carries what came before, then an error
    event naming structured_outputs; the request's blocks come back."""
    events = []
    body = {**CHAT, "max_tokens": 8, "temperature": 0, "guided_regex": "aa[^\\s\\S]", "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == "aa"
    err = events[-1]["error"]
    assert err["param"] == "structured_outputs" and "allows no token after" in err["message"]
    assert_idle_and_healthy(http)


def test_idle_and_slowloris_connections_time_out_and_stop_nobody(server, http):
    """200 connections that send nothing, or trickle a request head a byte at a time: normal requests are
    answered meanwhile, and each idle one is closed at the head deadline (1.5 s here), however it trickles."""
    config = ServerConfig(api_key=API_KEY, request_head_timeout=1.5, uvicorn_log_level="warning", access_log=False,
                          shutdown_timeout=2.0)
    srv = ServerThread(build_app(server.engine, config, shutdown_engine=False), config=config).start()
    socks, stop_trickle = [], threading.Event()
    try:
        t_open = time.monotonic()
        for i in range(200):
            s = socket.create_connection((srv.host, srv.port), timeout=10)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            socks.append(s)

        def trickle():  # one more header byte every 0.2 s on the odd ones, until they are closed
            while not stop_trickle.wait(0.2):
                for s in socks[1::2]:
                    try:
                        s.send(b"X")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(max(0.0, t_open + 0.8 - time.monotonic()))
        for s in socks:  # all still open before the deadline
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1, socket.MSG_PEEK)
            s.setblocking(True)
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as c:
            for _ in range(3):
                t0 = time.monotonic()
                assert c.post("/v1/completions", json={**COMP, "temperature": 0}).status_code == 200
                assert time.monotonic() - t0 < 10.0
        for s in socks:  # and every one closed by the server (a timeout here fails the test)
            s.settimeout(10)
            try:
                assert s.recv(4096) == b""
            except ConnectionResetError:
                pass
    finally:
        stop_trickle.set()
        for s in socks:
            s.close()
        srv.stop()
    assert_idle_and_healthy(http)


# ---- random bodies ------------------------------------------------------------------------------
junk = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
          "stop", "stream", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "echo", "stream_options",
          "response_format", "tools", "tool_choice", "chat_template", "priority", "logit_bias", "best_of",
          "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
sane = {"max_tokens": st.integers(1, 4), "prompt": st.sampled_from(["hi", [1, 2, 3], ["a", "b"]]),
        "messages": st.just([{"role": "user", "content": "hi"}]), "n": st.integers(1, 3)}


@st.composite
def bodies(draw):
    body = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=8, unique=True)):
        body[name] = draw(sane[name]) if name in sane and draw(st.booleans()) else draw(junk)
    body.setdefault("max_tokens", 2)
    return body


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies())
def test_random_bodies_never_hurt_the_server(http, route, body):
    r = raw(http, route, json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"))
    assert 200 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert "error" in r.json()


def test_after_the_storm_the_engine_is_idle_and_healthy(http):
    assert_idle_and_healthy(http)
    r = http.post("/v1/completions", json={**COMP, "temperature": 0})
    assert r.status_code == 200


# ---- a fuzzer driven by the server's own OpenAPI document ------------------------------------------
# For every POST route whose body the document declares, hypothesis draws bodies that fit the declared
# schema (tests/reference/openapi_strategies.py), and the same bodies with one field set to a hostile
# value; no answer may be a 5xx, nor an error event of the server's own making in a stream.  GET routes
# are called too.  Work per request is bounded (two completions a request; a body's max_tokens 8 when it
# has none, capped at 8 when it is a small positive number) so the examples fit the CI budget.

FUZZ_HOSTILE = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=12), st.lists(st.integers(-5, 2**66), max_size=3),
                    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2))


@pytest.fixture(scope="module")
def fuzz_http(server):
    """The module's engine behind a server that takes at most two completions a request."""
    config = ServerConfig(max_completions_per_request=2, uvicorn_log_level="warning", access_log=False,
                          shutdown_timeout=2.0)
    srv = ServerThread(build_app(server.engine, config, shutdown_engine=False), config=config).start()
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    srv.stop()


@pytest.fixture(scope="module")
def openapi(fuzz_http):
    doc = fuzz_http.get("/openapi.json").json()
    assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]  # the bodies are in the document
    return doc


def body_strategy(openapi: dict, path: str):
    """Bodies valid by the route's declared schema, and such bodies with one field made hostile."""
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = from_openapi_schema(ref, openapi["components"]["schemas"])
    model = openapi["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
    fields = sorted(model["properties"])
    hostile = st.tuples(valid, st.sampled_from(fields), FUZZ_HOSTILE).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(valid, hostile).map(bounded)


def bounded(body: dict) -> dict:
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 8  # a chat body's default is the rest of max_model_len
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and 8 < v <= MAX_MODEL_LEN:
            body[k] = 8
    return body


def check(http: httpx.Client, path: str, body: dict) -> None:
    data = json.dumps(body, allow_nan=False).encode()
    with http.stream("POST", path, content=data, headers={"Content-Type": "application/json"}) as r:
        text = r.read().decode()
    assert r.status_code < 500, (path, body, r.status_code, text[:500])
    if r.status_code >= 400:
        assert "error" in json.loads(text)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line[:20]:
                err = json.loads(line[6:])["error"]
                assert err["type"] != "internal_server_error", (path, body, err)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_schema_driven_bodies_never_get_a_5xx(fuzz_http, openapi, path):
    @settings(max_examples=60 if path.startswith("/v1") else 30, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=body_strategy(openapi, path))
    def run(body):
        check(fuzz_http, path, body)

    run()


def test_every_get_route_answers_without_a_5xx(fuzz_http, openapi):
    for path, ops in openapi["paths"].items():
        if "get" in ops and "{" not in path:
            assert fuzz_http.get(path).status_code < 500, path
    assert fuzz_http.get("/v1/models/no-such-model").status_code == 404


def test_after_the_fuzzing_every_block_is_back(http):
    assert_idle_and_healthy(http)
    assert http.post("/v1/completions", json={**COMP, "temperature": 0}).status_code == 200


def test_json_bytes_is_json_dumps():
    from roofline.entrypoints.openai.server import json_bytes

    for payload in [{"count": 3, "tokens": list(range(20000)), "token_strs": ['a"', "é", "\ud7ff"] * 7000, "m": 5},
                    {"prompt": 'x"y\n'}, {"tokens": [], "c": None}]:
        assert json.loads(json_bytes(payload)) == payload
