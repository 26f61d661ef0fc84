"""Tool calling, reasoning output, chat-template flags and the Responses API through the official openai
client against the server on the default model.  One engine, two apps on it: one with
--enable-auto-tool-choice --tool-call-parser hermes, one with --reasoning-parser deepseek_r1.

The small model does not choose tools by itself, so "auto" is exercised with a grammar that makes its
output a Hermes call (the parser then finds it); "required" and named choices are constrained by the
tools' schemas, so their arguments validate whatever the model writes (hypothesis draws the schemas)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app
from roofline.metrics.prometheus import metric_value, parse_metrics
from tests.engine.test_structured_outputs import SCHEMAS, validate

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                                                "enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM.from_engine_args(EngineArgs(model=None, device="cpu", dtype="float32", max_model_len=1024,
                                               max_num_seqs=8, seed=0))
    yield eng
    eng.shutdown()


def serve(engine, **kw):
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0, **kw)
    return ServerThread(build_app(engine, config, shutdown_engine=False), config=config).start()


@pytest.fixture(scope="module")
def tools_server(engine):
    srv = serve(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tools_server):
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reasoning_client(engine):
    srv = serve(engine, reasoning_parser="deepseek_r1")
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    srv.stop()


def streamed(stream):
    """(content, reasoning, {index: [id, name, arguments]}, finish_reason) of a chat stream."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name  # the first delta of a call: id and name
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.function.name is None
                calls[tc.index][2] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, reasoning, calls, finish


def test_named_tool_choice_streams_the_same_call(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, _, calls, finish = streamed(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and not content
    assert [(n, a) for _, n, a in calls.values()] == [("get_weather", call.function.arguments)]


def test_required_tool_choice_and_a_tool_result_round_trip(client):
    tools = {"get_weather": WEATHER, "get_time": TIME}
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, temperature=0)
    # parallel calls allowed: this model repeats its call until the length limit; the complete ones count
    many = client.chat.completions.create(**kw)
    assert many.choices[0].finish_reason == "length" and len(many.choices[0].message.tool_calls) >= 2
    _, _, scalls, _ = streamed(client.chat.completions.create(stream=True, **kw))
    assert [(n, a) for _, n, a in scalls.values()] == [(c.function.name, c.function.arguments)
                                                       for c in many.choices[0].message.tool_calls]
    r = client.chat.completions.create(parallel_tool_calls=False, **kw)  # one call at most
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    for c in calls + many.choices[0].message.tool_calls:
        validate(json.loads(c.function.arguments), tools[c.function.name]["function"]["parameters"])
    # the call and its result go back to the model, rendered by the template; then it answers in text
    follow = ASK + [r.choices[0].message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "sunny, 24 C"} for c in calls]
    r2 = client.chat.completions.create(model=MODEL, messages=follow, tools=[WEATHER, TIME], tool_choice="none",
                                        max_tokens=16, temperature=0)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


def test_auto_parses_the_models_hermes_call_and_none_never_calls(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    content, _, calls, finish = streamed(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and [(n, a) for _, n, a in calls.values()] == [
        ("get_weather", call.function.arguments)]
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=12,
                                           temperature=0)  # auto, and the model answers in text
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    none = client.chat.completions.create(tool_choice="none", **kw)  # the same call text stays text
    assert not none.choices[0].message.tool_calls and "<tool_call>" in none.choices[0].message.content
    assert none.choices[0].finish_reason == "stop"


def test_deprecated_functions_map_onto_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, functions=[WEATHER["function"]],
                                       function_call={"name": "get_weather"}, max_tokens=60, temperature=0)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, named=st.booleans())
def test_constrained_calls_validate_against_any_schema(client, schema, named):
    tool = {"type": "function", "function": {"name": "record", "parameters": schema}}
    choice = {"type": "function", "function": {"name": "record"}} if named else "required"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}],
                                       tools=[tool], tool_choice=choice, max_tokens=120, temperature=0.8, seed=3,
                                       parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for c in calls:
        validate(json.loads(c.function.arguments), schema)


@pytest.mark.parametrize("body,word", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "at least one tool"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
     "JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "function"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400s_naming_the_field(tools_server, body, word):
    r = httpx.post(tools_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and word in r.text, r.text


def test_auto_needs_the_server_flag(engine):
    srv = serve(engine)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "max_tokens": 4})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.text
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                        json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4})
        assert ok.status_code == 200
    finally:
        srv.stop()


def test_reasoning_split_streamed_and_whole(reasoning_client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=40, temperature=0,
              extra_body={"structured_outputs": {"regex": r"<think>[a-z ]{3,30}</think>[A-Z][a-z ]{3,30}\."}})
    r = reasoning_client.chat.completions.create(**kw)
    m = r.choices[0].message
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning and m.content and "<think>" not in m.content and "</think>" not in reasoning
    assert m.model_extra["reasoning"] == reasoning
    content, sreasoning, _, _ = streamed(reasoning_client.chat.completions.create(stream=True, **kw))
    assert (content, sreasoning) == (m.content, reasoning)


def test_responses_api_text_tools_stream_and_previous_response(client):
    r = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=8,
                                temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.output_tokens > 0
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r2 = client.responses.create(model=MODEL, input=ASK[0]["content"], tools=[tool],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                 temperature=0)
    (call,) = [it for it in r2.output if it.type == "function_call"]
    validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    events = list(client.responses.create(model=MODEL, input=ASK[0]["content"], tools=[tool],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=60, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and "response.output_item.added" in kinds
    text_events = list(client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.",
                                               max_output_tokens=8, temperature=0, stream=True))
    assert "".join(e.delta for e in text_events if e.type == "response.output_text.delta") == r.output_text
    # the tool's result continues the stored conversation
    r3 = client.responses.create(model=MODEL, previous_response_id=r2.id, max_output_tokens=12, temperature=0,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny, 24 C"}])
    assert r3.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2)


def test_chat_template_flag_content_parts_and_echo(engine):
    template = ("{% for m in messages %}[{{ m.role }}]{% for p in m.content %}{{ p.text }}{% endfor %}\n"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    srv = serve(engine, chat_template=template)  # the template loops over parts: auto picks "openai"
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]
        tok = httpx.post(srv.url + "/tokenize", json={"messages": msgs}).json()
        assert tok["count"] > 0
        r = c.chat.completions.create(model=MODEL, messages=msgs + [{"role": "assistant", "content": "Well,"}],
                                      max_tokens=4, temperature=0,
                                      extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                  "echo": True})
        assert r.choices[0].message.content.startswith("Well,")
    finally:
        srv.stop()


def test_beam_search_through_the_api_equals_the_offline_search(client, tools_server, default_llm):
    """use_beam_search with n as the width: the choices are the offline LLM.beam_search beams (which equal
    HF's, tests/engine/test_beam_search.py), best first; streaming one and too wide a beam are 400s."""
    from roofline.sampling_params import BeamSearchParams

    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, temperature=0,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5})
    offline = default_llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5))
    assert [c.text for c in r.choices] == [b.text for b in offline[0].sequences]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=5,
                                          extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and chat.choices[0].message.content
    for body, word in [({"stream": True, "n": 2}, "stream"), ({"n": 65}, "beam_width")]:
        bad = httpx.post(tools_server.url + "/v1/completions", timeout=60,
                         json={"prompt": prompt, "max_tokens": 2, "use_beam_search": True, **body})
        assert bad.status_code == 400 and word in bad.text, bad.text


def test_everything_returned_its_blocks(tools_server):
    m = parse_metrics(httpx.get(tools_server.url + "/metrics").text)
    assert metric_value(m, "roofline:kv_cache_num_free_blocks") == metric_value(m, "roofline:kv_cache_num_blocks")
