"""The OpenAI server with LoRA adapters (the engine core in its own process): `"model": "<adapter>"` selects
an adapter, mixed concurrent requests give PEFT's tokens, /v1/models lists adapters with their parent,
unknown names are 404s and bad adapters 400s naming them, and adapters load and unload at runtime behind
--allow-runtime-lora-updating and the API key."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import httpx
import pytest

from roofline.config import EngineArgs
from roofline.engine.async_llm import AsyncLLM
from roofline.entrypoints.openai.server import ServerConfig, ServerThread, build_app
from roofline.entrypoints.openai.serving_models import LoRAModulePath, ServingModels, parse_lora_module
from roofline.lora.mapping import AdapterValidator
from tests.lora.conftest import MAX_TOKENS, MIX
from tests.router.cluster import token_ids

API_KEY = "sk-lora-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BASE = "tiny-base"


@pytest.fixture(scope="module")
def family(lora_family):
    return lora_family("llama")


@pytest.fixture(scope="module")
def server(family):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=family.path, device="cpu", dtype="float32", num_kv_blocks=128,
                                                  served_model_name=BASE, enable_lora=True, max_loras=2,
                                                  max_lora_rank=8, step_roofline=False))
    a1, a2 = family.loras[1], family.loras[2]
    config = ServerConfig(api_key=API_KEY, uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0,
                          lora_modules=(parse_lora_module(f"a1={a1.lora_path}"),
                                        parse_lora_module(json.dumps({"name": "a2", "path": a2.lora_path,
                                                                      "base_model_name": "tiny-llama"}))),
                          allow_runtime_lora_updating=True)
    srv = ServerThread(build_app(engine, config, shutdown_engine=False), config=config).start()
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


def body(prompt, model=None, **extra):
    d = dict(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0, **extra)
    if model is not None:
        d["model"] = model
    return d


def complete(http, prompt, model=None) -> list[int]:
    r = http.post("/v1/completions", json=body(prompt, model))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == (model or BASE)
    return token_ids(r.json()["choices"][0]["logprobs"]["tokens"])


def test_models_lists_adapters_with_parent(http, family):
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert list(cards) == [BASE, "a1", "a2"]
    assert cards["a1"]["parent"] == BASE and cards["a1"]["root"] == family.loras[1].lora_path
    assert cards["a2"]["parent"] == "tiny-llama"
    assert cards[BASE]["parent"] is None
    assert http.get("/v1/models/a2").json()["root"] == family.loras[2].lora_path
    assert http.get("/v1/models/nope").status_code == 404


def test_metrics_name_the_running_adapter_as_vllm_does(server, http, family):
    """vllm:lora_requests_info (what a gateway's LoRA-affinity scorer reads) names a1 while a request runs
    under it, with max_lora; our roofline: name carries the same series.  Every series the server's logger
    renders during the request is captured (a tiny model's request ends within a few scrapes)."""
    from roofline.metrics.prometheus import PrometheusStatLogger, parse_metrics

    logger = next(sl for sl in server.engine.stat_loggers if isinstance(sl, PrometheusStatLogger))
    seen, record = [], logger.record

    def recording(stats):
        record(stats)
        seen.append(parse_metrics(logger.render().decode()))

    logger.record = recording
    try:
        assert complete(http, family.prompts[0], "a1")
    finally:
        logger.record = record
    running = [m for m in seen if any('running_lora_adapters="a1"' in k for k in m)]
    assert running, "no scrape saw a1 running"
    info = [k for k in running[0] if k.startswith("vllm:lora_requests_info")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
    assert "roofline:" + info[0][len("vllm:"):] in running[0]
    assert any(k.startswith("vllm:lora_requests_info") for k in parse_metrics(http.get("/metrics").text))


def test_mixed_concurrent_requests_match_peft(server, family):
    names = [None, "a1", "a2"]

    async def one(c, i):
        stream = i == 3  # one of them streamed
        d = body(family.prompts[i], names[MIX[i]], stream=stream)
        if not stream:
            r = await c.post("/v1/completions", json=d)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (names[MIX[i]] or BASE)
            return token_ids(r.json()["choices"][0]["logprobs"]["tokens"])
        tokens = []
        async with c.stream("POST", "/v1/completions", json=d) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert chunk["model"] == names[MIX[i]]
                    for ch in chunk["choices"]:
                        tokens += (ch.get("logprobs") or {}).get("tokens", [])
        return token_ids(tokens)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(len(MIX))))

    assert asyncio.run(run()) == family.expected


def test_unknown_model_is_a_404_naming_it(http, family):
    for route, extra in (("/v1/completions", dict(prompt=family.prompts[0])),
                         ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}]))):
        r = http.post(route, json=dict(model="no-such-adapter", max_tokens=2, **extra))
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "no-such-adapter" in err["message"] and err["param"] == "model"
    assert complete(http, family.prompts[1], "a1") == family.expected[1]  # still serving


def test_runtime_load_and_unload(http, family):
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": family.loras[2].lora_path})
    assert r.status_code == 200, r.text
    assert "a3" in [c["id"] for c in http.get("/v1/models").json()["data"]]
    assert complete(http, family.prompts[2], "a3") == family.expected[2]  # a2's weights under another name
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": "/x"}).status_code == 400
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 200, r.text
    assert "a3" not in [c["id"] for c in http.get("/v1/models").json()["data"]]
    assert http.post("/v1/completions", json=body(family.prompts[2], "a3")).status_code == 404
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert r.status_code == 404 and "a3" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a3", "lora_path": family.loras[1].lora_path})
    assert r.status_code == 200  # the name again, now a1's weights: a new adapter
    assert complete(http, family.prompts[1], "a3") == family.expected[1]
    http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})


def test_bad_adapters_are_400s_naming_them(http, family, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(family.loras[1].lora_path, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(dict(cfg, modules_to_save=["lm_head"])))
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
    assert r.status_code == 400 and "'bad'" in r.json()["error"]["message"] and "modules_to_save" in r.text
    # files gone between loading and the first request: the engine refuses it (400 naming it), not the base model
    gone = tmp_path / "gone"
    shutil.copytree(family.loras[1].lora_path, gone)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(gone)}).status_code == 200
    shutil.rmtree(gone)
    r = http.post("/v1/completions", json=body(family.prompts[1], "gone"))
    assert r.status_code == 400 and "'gone'" in r.json()["error"]["message"] and r.json()["error"]["param"] == "model"
    http.post("/v1/unload_lora_adapter", json={"lora_name": "gone"})
    assert complete(http, family.prompts[0]) == family.expected[0]


def test_runtime_routes_need_the_key_and_the_flag(server, family):
    body_ = {"lora_name": "x", "lora_path": family.loras[1].lora_path}
    assert httpx.post(server.url + "/v1/load_lora_adapter", json=body_).status_code == 401
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 401
    config = ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=2.0)
    srv = ServerThread(build_app(server.engine, config, shutdown_engine=False), config=config).start()
    try:
        assert httpx.post(srv.url + "/v1/load_lora_adapter", json=body_).status_code == 404
        assert [c["id"] for c in httpx.get(srv.url + "/v1/models").json()["data"]] == [BASE]
    finally:
        srv.stop()


def test_lora_modules_flag_parsing_and_startup_errors(family, tmp_path):
    assert parse_lora_module("a=/p") == LoRAModulePath("a", "/p")
    assert parse_lora_module('{"name": "b", "path": "/q", "base_model_name": "m"}') == LoRAModulePath("b", "/q", "m")
    for bad in ("a", "=/p", '{"name": "b"}', '{"name": "b", "path": "/q", "rank": 4}', "{nope"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    validator = AdapterValidator(family.refs[0].config, 8)
    with pytest.raises(ValueError, match="LoRA adapter 'missing'.*not a directory"):
        ServingModels([BASE], BASE, 512, 384, validator, (LoRAModulePath("missing", str(tmp_path / "none")),))
    with pytest.raises(ValueError, match="base model's name"):
        ServingModels([BASE], BASE, 512, 384, validator, (LoRAModulePath(BASE, family.loras[1].lora_path),))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        ServingModels([BASE], BASE, 512, 384, None, (LoRAModulePath("a", family.loras[1].lora_path),))
    assert os.path.isdir(family.loras[1].lora_path)


def test_serve_refuses_lora_flags_without_enable_lora():
    from roofline.entrypoints import serve_cmd

    with pytest.raises(SystemExit, match="need --enable-lora"):
        serve_cmd.main(["--lora-modules", "a=/x", "--port", "0"])
    with pytest.raises(SystemExit, match="expected name=path"):
        serve_cmd.main(["--enable-lora", "--lora-modules", "a", "--port", "0"])
