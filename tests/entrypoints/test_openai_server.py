"""The OpenAI-compatible server on the real default model, driven by the official `openai` client
and raw HTTP. One server for the whole module (loading the model dominates the cost)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app
from roofline.metrics.prometheus import metric_value, parse_metrics

API_KEY = "sk-roofline-test"
MAX_MODEL_LEN = 512
BODY_LIMIT = 256 * 1024
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLM.from_engine_args(EngineArgs(model=None, device="cpu", dtype="float32",
                                                  max_model_len=MAX_MODEL_LEN, seed=0))
    config = ServerConfig(api_key=API_KEY, max_request_body_bytes=BODY_LIMIT, uvicorn_log_level="warning",
                          access_log=False, shutdown_timeout=5.0)
    srv = ServerThread(build_app(engine, config), config=config).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()
    assert not engine._thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient_factory(server):
    def make():
        return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    return make


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def metrics(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


def wait_idle(http, timeout=30.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block is held by a request."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        idle = (metric_value(m, "roofline:num_requests_running") == 0
                and metric_value(m, "roofline:num_requests_waiting") == 0
                and metric_value(m, "roofline:kv_cache_usage_perc") == 0
                and metric_value(m, "roofline:kv_cache_num_free_blocks")
                == metric_value(m, "roofline:kv_cache_num_blocks"))
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def assert_healthy(http):
    assert http.get("/health").status_code == 200


PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


# --------------------------------------------------------------------------- basics
def test_models_health_version(client, http):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [MODEL]
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["max_model_len"] == MAX_MODEL_LEN and card["vocab_size"] >= 49152
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/version").json()["version"]
    text = http.get("/metrics").text
    for name in ("roofline:time_to_first_token_seconds", "roofline:num_requests_running",
                 "roofline:kv_cache_usage_perc", "roofline:request_success_total"):
        assert name in text


def test_completion_stream_equals_nonstream(client, http):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert full.usage.prompt_tokens == n_prompt
    assert full.usage.total_tokens == n_prompt + 12

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_stream_equals_nonstream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert full.object == "chat.completion"
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_async_client_chat_and_completion(aclient_factory, client):
    expected = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)

    async def main():
        ac = aclient_factory()
        chat = await ac.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
        stream = await ac.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                  stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        comp = await ac.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
        await ac.close()
        return chat, text, comp

    chat, text, comp = asyncio.run(main())
    assert chat.choices[0].message.content == expected.choices[0].message.content == text
    assert comp.usage.completion_tokens == 4


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop
    expected = base[: base.find(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_2(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.9, seed=3, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0.9, seed=3, n=2)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    streamed = {0: "", 1: ""}
    for c in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0.9,
                                            seed=3, n=2, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == {c.index: c.message.content for c in chat.choices}


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(tlp)  # greedy: the chosen token is the most likely
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_usage_reports_cached_prompt_tokens(client):
    prompt = "Here is a long shared preamble about serving systems and key-value caches. " * 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    details = again.usage.prompt_tokens_details
    assert details.cached_tokens >= 16
    assert details.cached_tokens < again.usage.prompt_tokens


def test_echo_and_token_id_prompt(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    text = out.choices[0].text
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_echo_scores_prompt_with_max_tokens_0(client, http):
    """The eval-harness pattern: echo + max_tokens=0 + logprobs returns the prompt's logprobs only."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    # echo + generation: prompt logprobs, then the generated tokens'
    gen = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1, temperature=0)
    glp = gen.choices[0].logprobs
    assert len(glp.tokens) == len(ids) + 2 and glp.token_logprobs[: len(ids)] == pytest.approx(
        [None] + lp.token_logprobs[1:], abs=1e-4)
    assert "".join(glp.tokens) == gen.choices[0].text


def test_batch_of_prompts(client):
    out = client.completions.create(model=MODEL, prompt=[PROMPT, "Two plus two is"], max_tokens=3, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt="Two plus two is", max_tokens=3, temperature=0)
    assert out.choices[1].text == single.choices[0].text


def test_max_completion_tokens_and_extra_fields(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert out.usage.completion_tokens <= 3
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 6,
                    "priority": 0})
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_stream_include_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""
    events = events[:-1]
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_tokenize_detokenize(http):
    tok = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert len(tok["token_strs"]) == tok["count"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > 5
    r = http.post("/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400


# --------------------------------------------------------------------------- errors
def _post(http, path, body=None, content=None, headers=None):
    if content is None:
        content = json.dumps(body).encode()
    h = {"content-type": "application/json", **(headers or {})}
    return http.post(path, content=content, headers=h)


ERROR_CASES = [
    ("malformed-json", "/v1/completions", None, b'{"prompt": "hi",', 400, None),
    ("not-an-object", "/v1/completions", None, b"[1, 2]", 400, None),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, None, 400, "prompt"),
    ("bad-type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, None, 400, "temperature"),
    ("bad-top-p", "/v1/completions", {"prompt": "hi", "top_p": 5}, None, 400, "top_p"),
    ("bad-n", "/v1/completions", {"prompt": "hi", "n": 0}, None, 400, "n"),
    ("bad-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, None, 400, "max_tokens"),
    ("bad-logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 99}, None, 400, "logprobs"),
    ("empty-prompt", "/v1/completions", {"prompt": []}, None, 400, "prompt"),
    ("bad-token-id", "/v1/completions", {"prompt": [10**8]}, None, 400, "prompt"),
    ("missing-messages", "/v1/chat/completions", {"model": MODEL}, None, 400, "messages"),
    ("bad-message", "/v1/chat/completions", {"messages": [{"content": "x"}]}, None, 400, "messages"),
    ("bad-top-logprobs", "/v1/chat/completions",
     {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs"),
    ("unknown-model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, None, 404, "model"),
    ("unknown-model-chat", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, None, 404, "model"),
]


@pytest.mark.parametrize("name,path,body,content,status,param", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_cases(http, name, path, body, content, status, param):
    r = _post(http, path, body, content)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    assert_healthy(http)


def test_prompt_too_long_names_lengths(http):
    r = _post(http, "/v1/completions", {"prompt": [100] * 500, "max_tokens": 20})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "500" in msg and "20" in msg and str(MAX_MODEL_LEN) in msg
    r = _post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]})
    assert r.status_code == 400 and str(MAX_MODEL_LEN) in r.json()["error"]["message"]
    assert_healthy(http)


def test_body_too_large(http):
    big = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode()
    r = _post(http, "/v1/completions", content=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # chunked upload (no Content-Length) is limited too
    r = http.post("/v1/completions", content=iter([big[:BODY_LIMIT // 2], big[BODY_LIMIT // 2:]]),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert_healthy(http)


def test_api_key_required_on_v1(server, http):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
            r = anon.request(method, path, json={"prompt": "hi"})
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = anon.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert anon.get("/health").status_code == 200  # operational routes stay open
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_queue_full_gives_503_with_retry_after(server, http, client):
    server.engine.max_waiting_requests = 0
    try:
        r = _post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        r = _post(http, "/v1/chat/completions", {"messages": CHAT, "stream": True})
        assert r.status_code == 503
    finally:
        server.engine.max_waiting_requests = None
    assert_healthy(http)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1


def test_unknown_route_in_openai_shape(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404
    assert "error" in r.json()


# --------------------------------------------------------------------------- concurrency and aborts
def test_64_concurrent_streams_match_sequential(client, aclient_factory, http):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(64)]
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    sequential = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]

    async def one(ac, p):
        text = ""
        stream = await ac.completions.create(prompt=p, stream=True, **kw)
        async for c in stream:
            if c.choices:
                text += c.choices[0].text
        return text

    async def main():
        ac = aclient_factory()
        try:
            return await asyncio.gather(*(one(ac, p) for p in prompts))
        finally:
            await ac.close()

    concurrent = asyncio.run(main())
    assert concurrent == sequential
    m = wait_idle(http)
    assert metric_value(m, "roofline:num_requests_running") == 0
    assert metric_value(m, "roofline:num_requests_waiting") == 0
    assert metric_value(m, "roofline:kv_cache_usage_perc") == 0
    assert metric_value(m, "roofline:kv_cache_num_free_blocks") == metric_value(m, "roofline:kv_cache_num_blocks")
    assert metric_value(m, "roofline:time_to_first_token_seconds_count") >= 128
    finished = sum(metric_value(m, "roofline:request_success_total", finish_reason=r) for r in ("length", "stop"))
    assert finished >= 128


def _aborts(http) -> float:
    return metric_value(metrics(http), "roofline:request_success_total", finish_reason="abort")


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, http):
    before = _aborts(http)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                if events >= 3:
                    break
        # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 30
    while _aborts(http) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborts(http) == before + 1
    m = wait_idle(http)
    assert metric_value(m, "roofline:kv_cache_usage_perc") == 0
    assert metric_value(m, "roofline:kv_cache_num_free_blocks") == metric_value(m, "roofline:kv_cache_num_blocks")
    assert metric_value(m, "roofline:generation_tokens_total") > 0
    assert_healthy(http)


def test_client_disconnect_non_streaming_aborts(server, http):
    before = _aborts(http)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.5) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=body)
    deadline = time.monotonic() + 30
    while _aborts(http) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborts(http) == before + 1
    wait_idle(http)


# --------------------------------------------------------------------------- benchmark client
def test_bench_serve_against_server(server, tmp_path, capsys):
    from roofline.benchmarks import serve as bench

    parser = bench.argparse.ArgumentParser()
    sub = parser.add_subparsers()
    bench.register(sub)
    png, out = tmp_path / "lat.png", tmp_path / "res.json"
    args = parser.parse_args([
        "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "6",
        "--random-input-len", "8:16", "--random-output-len", "3:6", "--request-rate", "50",
        "--goodput", "ttft:60000", "tpot:60000", "--plot", str(png), "--save-result", str(out),
        "--disable-tqdm"])
    assert args.func(args) == 0
    report = capsys.readouterr().out
    for label in ("Request throughput", "Output token throughput", "Mean TTFT", "Median TPOT", "P99 ITL",
                  "Mean E2EL", "Goodput"):
        assert label in report
    doc = json.loads(out.read_text())
    m = doc["metrics"]
    assert m["completed"] == 6 and m["failed"] == 0
    assert m["total_output_tokens"] == m["expected_output_tokens"]
    assert m["good_requests"] == 6
    assert png.stat().st_size > 10_000


# --------------------------------------------------------------------------- structured outputs
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                "population": {"type": "integer", "minimum": 0}},
               "required": ["city", "population"]}


def test_structured_outputs_every_form(client, http):
    import re

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city and its population as JSON."}],
        max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
    value = json.loads(chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop" and set(value) == {"city", "population"}
    assert isinstance(value["population"], int) and isinstance(value["city"], str)
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 'Repeat {"ok": true}'}],
                                         max_tokens=150, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0.9,
                                       n=3, seed=1, extra_body={"guided_choice": ["yes", "no"]})
    assert all(c.text in ("yes", "no") for c in choice.choices) and len(choice.choices) == 3
    stream = client.completions.create(model=MODEL, prompt="Phone number:", max_tokens=20, temperature=1.0, seed=2,
                                       stream=True, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", "".join(ch.choices[0].text for ch in stream if ch.choices))
    both = client.completions.create(model=MODEL, prompt="Temperature:", max_tokens=10, temperature=0,
                                     extra_body={"guided_grammar": 'root ::= [0-9] [0-9]? " C"'})
    assert re.fullmatch(r"[0-9][0-9]? C", both.choices[0].text)
    wait_idle(http)


@pytest.mark.parametrize("body, param, problem", [
    ({"guided_regex": "(ab"}, "guided_regex", "invalid guided_regex: .*parenthesis"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", "invalid guided_json: .*nonsense"),
    ({"guided_json": "{bad"}, "guided_json", "invalid guided_json: the schema is not valid JSON"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "invalid guided_grammar"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", r"unknown key\(s\) \['regexp'\]"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "invalid response_format: .*nonsense"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one structured output constraint"),
])
def test_structured_outputs_bad_constraint_is_400(http, body, param, problem):
    import re

    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 4, **base, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and re.search(problem, err["message"]), err
    assert_healthy(http)
    m = wait_idle(http)
    assert metric_value(m, "roofline:kv_cache_num_free_blocks") == metric_value(m, "roofline:kv_cache_num_blocks")
