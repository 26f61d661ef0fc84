"""`roofline bench serve`: workload generators (bit-identical to BENCHMARKS.md), arrivals, metrics,
plots, and the client end to end against a small fake OpenAI streaming server."""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from roofline.benchmarks import serve as bench
from roofline.benchmarks.datasets import (
    arrival_times,
    random_requests,
    sharegpt_requests,
    shared_prefix_requests,
    token_id_high,
)
from roofline.benchmarks.plots import plot_benchmark, time_series
from roofline.entrypoints.openai.server import ServerConfig, ServerThread


# --------------------------------------------------------------------------- datasets
def spec_generator(n, in_min, in_max, out_min, out_max, seed, hi=49000):
    """BENCHMARKS.md's generator, written out literally."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(in_min, in_max)
        prompt = [rng.randrange(100, hi) for _ in range(L)]
        O = rng.randint(out_min, out_max)
        out.append((prompt, O))
    return out


def test_random_dataset_is_the_w1_w2_workload():
    reqs = random_requests(64, (64, 256), (32, 256), seed=0)
    assert sum(r.output_len for r in reqs) == 9409  # BENCHMARKS.md: W1 CPU total output tokens
    spec = spec_generator(64, 64, 256, 32, 256, 0)
    assert [(r.prompt, r.output_len) for r in reqs] == spec
    assert all(r.prompt_len == len(r.prompt) for r in reqs)


def test_small_vocab_bounds_token_ids():
    assert token_id_high(None) == token_id_high(49152) == 49000
    assert token_id_high(512) == 412
    reqs = random_requests(8, (10, 20), (1, 2), seed=3, vocab_size=512)
    assert [(r.prompt, r.output_len) for r in reqs] == spec_generator(8, 10, 20, 1, 2, 3, hi=412)
    assert max(t for r in reqs for t in r.prompt) < 412


def test_shared_prefix_dataset_is_w3():
    reqs = shared_prefix_requests(64, 512, 32, 32, seed=1)
    rng = random.Random(1)
    prefix = [rng.randrange(100, 49000) for _ in range(512)]
    for r in reqs:
        suffix = [rng.randrange(100, 49000) for _ in range(32)]
        assert r.prompt == prefix + suffix and r.prompt_len == 544 and r.output_len == 32


def test_arrivals():
    assert arrival_times(5, float("inf")) == [0.0] * 5
    t = arrival_times(2000, 10.0, seed=0)
    assert t[0] == 0.0 and t == sorted(t)
    assert t == arrival_times(2000, 10.0, seed=0)
    assert t[-1] / 1999 == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError):
        arrival_times(3, 0.0)


def test_sharegpt_file(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": f"question number {i} " * (i + 2)},
                           {"from": "gpt", "value": "answer word " * (i + 2)}]}
        for i in range(20)
    ]
    data.append({"conversations": [{"from": "human", "value": "only one turn"}]})
    data.append({"conversations": [{"from": "human", "value": "a b"}, {"from": "gpt", "value": "c d e f g"}]})
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))

    def tokenize(text):
        return [len(w) for w in text.split()]

    reqs = sharegpt_requests(str(path), 10, tokenize, seed=0)
    assert len(reqs) == 10
    for r in reqs:
        assert r.prompt_len == len(r.prompt) >= 4 and r.output_len >= 4
    assert reqs == sharegpt_requests(str(path), 10, tokenize, seed=0)
    fixed = sharegpt_requests(str(path), 5, tokenize, seed=1, fixed_output_len=7)
    assert all(r.output_len == 7 for r in fixed)
    with pytest.raises(ValueError, match="usable"):
        sharegpt_requests(str(path), 100, tokenize)


# --------------------------------------------------------------------------- metrics
def result(ttft, latency, out, itls=(), start=0.0):
    r = bench.RequestResult(success=True, prompt_len=10, expected_output_len=out, output_len=out, ttft=ttft,
                            latency=latency, itls=list(itls), start_time=start)
    r.chunk_times = [start + ttft + sum(itls[:i]) for i in range(len(itls) + 1)]
    return r


def test_compute_metrics_and_goodput():
    results = [result(0.1, 1.1, 11, [0.1] * 10), result(0.5, 2.5, 5, [0.5] * 4, start=0.5),
               bench.RequestResult(success=False, error="HTTP 500")]
    m = bench.compute_metrics(results, 2.0, bench.parse_goodput(["ttft:200", "tpot:150"]))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(8.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert m["ttft_ms"]["median"] == pytest.approx(300.0)
    assert m["tpot_ms"]["mean"] == pytest.approx((100.0 + 500.0) / 2)
    assert m["itl_ms"]["median"] == pytest.approx(100.0)
    assert m["e2el_ms"]["p99"] == pytest.approx(2500.0, rel=0.02)
    assert m["good_requests"] == 1 and m["goodput"] == pytest.approx(0.5)
    text = bench.format_report(m)
    assert "Goodput" in text and "P99 ITL (ms)" in text and "Median TPOT (ms)" in text


def test_argument_parsers():
    assert bench.parse_range("64:256") == (64, 256)
    assert bench.parse_range("32") == (32, 32)
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_range("9:3")
    assert bench.parse_rate("inf") == float("inf")
    assert bench.parse_rate("2.5") == 2.5
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_rate("-1")
    assert bench.parse_goodput(["ttft:1000", "tpot:100", "e2el:5000"]) == {"ttft": 1.0, "tpot": 0.1,
                                                                         "latency": 5.0}
    with pytest.raises(ValueError):
        bench.parse_goodput(["speed:3"])


def test_plot_and_time_series(tmp_path):
    results = [result(0.1 * i, 1.0 + 0.1 * i, 8, [0.1] * 7, start=0.2 * i) for i in range(10)]
    ts = time_series(results, 4.0, bins=20)
    assert sum(ts["tokens_per_s"]) * (4.0 / 20) == pytest.approx(80.0)
    assert max(ts["in_flight"]) > 1
    out = tmp_path / "p.png"
    plot_benchmark(str(out), results, 4.0, title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- end to end (fake server)
def fake_openai_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "max_model_len": 4096,
                                            "vocab_size": 1000}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        ids = [len(w) for w in body["prompt"].split()]
        return {"tokens": ids, "count": len(ids), "max_model_len": 4096}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["requests"].append(body)
        if body.get("max_tokens") == 13:
            return StreamingResponse(iter(['data: {"error": {"message": "boom"}}\n\n', "data: [DONE]\n\n"]))

        async def gen():
            state["inflight"] += 1
            state["max_inflight"] = max(state["max_inflight"], state["inflight"])
            try:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(0.002)
                    yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"w{i} ",
                                                              "finish_reason": None}]}) + "\n\n"
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + "\n\n"
                if body.get("stream_options", {}).get("include_usage"):
                    yield "data: " + json.dumps({"choices": [], "usage": {
                        "prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    state = {"requests": [], "inflight": 0, "max_inflight": 0}
    srv = ServerThread(fake_openai_app(state), config=ServerConfig(uvicorn_log_level="warning", access_log=False))
    srv.start()
    srv.state = state
    yield srv
    srv.stop()


def parse(argv):
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_bench_cli_end_to_end(fake_server, tmp_path, capsys):
    fake_server.state["requests"].clear()
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = parse(["--base-url", fake_server.url, "--num-prompts", "12", "--random-input-len", "5:9",
                  "--random-output-len", "3:8", "--request-rate", "200", "--max-concurrency", "3",
                  "--goodput", "ttft:10000", "--save-result", str(out), "--plot", str(png), "--disable-tqdm"])
    assert args.func(args) == 0
    sent = fake_server.state["requests"]
    assert len(sent) == 13  # one warm-up
    expected = random_requests(12, (5, 9), (3, 8), seed=0, vocab_size=1000)
    body = sent[1:]
    assert sorted(map(json.dumps, (b["prompt"] for b in body))) == sorted(json.dumps(r.prompt) for r in expected)
    b0 = body[0]
    assert b0["stream"] is True and b0["temperature"] == 0 and b0["ignore_eos"] is True
    assert b0["model"] == "fake-model"
    assert fake_server.state["max_inflight"] <= 3
    doc = json.loads(out.read_text())
    assert doc["metrics"]["completed"] == 12
    assert doc["metrics"]["total_output_tokens"] == sum(r.output_len for r in expected)
    assert len(doc["requests"]) == 12 and all(r["ttft"] > 0 for r in doc["requests"])
    assert all(len(r["itls"]) == r["output_len"] - 1 for r in doc["requests"])
    assert png.exists()
    assert "Successful requests:" in capsys.readouterr().out


def test_bench_counts_failures(fake_server):
    cfg = bench.BenchConfig(base_url=fake_server.url, num_warmups=0, disable_tqdm=True)
    reqs = [bench.SampleRequest([1, 2, 3], 3, 13), bench.SampleRequest([1, 2, 3], 3, 4)]
    results, duration = asyncio.run(bench.run_requests(cfg, reqs, model="fake-model"))
    assert [r.success for r in results] == [False, True]
    assert "boom" in results[0].error
    bad = bench.BenchConfig(base_url="http://127.0.0.1:1", num_warmups=0, disable_tqdm=True)
    results, _ = asyncio.run(bench.run_requests(bad, reqs[1:], model="m"))
    assert not results[0].success and results[0].error


def test_bench_sharegpt_via_server_tokenize(fake_server, tmp_path):
    data = [{"conversations": [{"from": "human", "value": "alpha beta gamma delta epsilon " * 2},
                               {"from": "gpt", "value": "one two three four five"}]}] * 6
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    fake_server.state["requests"].clear()
    args = parse(["--base-url", fake_server.url, "--dataset-path", str(path), "--num-prompts", "4",
                  "--num-warmups", "0", "--disable-tqdm"])
    assert args.func(args) == 0
    sent = fake_server.state["requests"]
    assert len(sent) == 4 and all(len(b["prompt"]) == 10 and b["max_tokens"] == 5 for b in sent)
