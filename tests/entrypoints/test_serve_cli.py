"""`roofline serve` as a process: flags, API key, queue-full 503, graceful SIGTERM (exit 0).

Uses a tiny Llama-shaped model with random weights (`--load-format dummy`, no tokenizer: token-id
prompts only) so the process starts in seconds.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from roofline.metrics.prometheus import metric_value, parse_metrics

KEY = "cli-key"
TINY_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}
READY = re.compile(r"serving model '([^']+)' on (http://[\d.]+:\d+)")


class ServeProcess:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "roofline.entrypoints.serve_cmd", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = None
        self.model = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = READY.search(line)
            if m:
                self.model, self.url = m.group(1), m.group(2)
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 240.0) -> None:
        self._ready.wait(timeout)
        if self.url is None:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines[-40:]))

    def log(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    p = ServeProcess([str(d), "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
                      "--max-model-len", "4096", "--port", "0", "--api-key", KEY, "--max-num-seqs", "1",
                      "--max-waiting-requests", "1", "--log-stats-interval", "0", "--disable-access-log",
                      "--shutdown-timeout", "60"])
    p.wait_ready()
    yield p
    if p.proc.poll() is None:
        p.proc.kill()
        p.proc.wait()


def client(p: ServeProcess, key: str | None = KEY, timeout: float = 60) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=p.url, headers=headers, timeout=timeout)


def test_serve_help_lists_flags():
    out = subprocess.run([sys.executable, "-m", "roofline.entrypoints.serve_cmd", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--max-request-body-bytes",
                 "--max-waiting-requests", "--max-num-seqs", "--block-size", "--speculative-config", "MODEL"):
        assert flag in out.stdout


def test_api_key_and_token_id_prompts(served):
    assert served.model.startswith("tiny-llama")
    with client(served, key=None) as anon:
        assert anon.get("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200
    with client(served) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == served.model
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        # no tokenizer: text prompts and chat are refused with a clear 400
        r = c.post("/v1/completions", json={"prompt": "hello"})
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}).status_code == 400


def _stream_events(c: httpx.Client, body: dict):
    with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield line[len("data: "):]


def _waiting(c: httpx.Client) -> float:
    return metric_value(parse_metrics(c.get("/metrics").text), "roofline:num_requests_waiting")


def test_queue_full_is_503_with_retry_after(served):
    # A must still be running when B arrives, however slow the machine: 4000 tokens take seconds even on
    # this tiny model (at 240 a loaded CI machine once saw A finish before B was queued)
    long_body = {"prompt": [5, 6, 7, 8], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with client(served) as a, client(served) as b, client(served) as c:
        events = _stream_events(a, long_body)
        next(events)  # A runs (max-num-seqs 1)
        result = {}
        t = threading.Thread(target=lambda: result.update(r=b.post("/v1/completions", json={
            "prompt": [9, 10], "max_tokens": 2, "ignore_eos": True})))
        t.start()  # B waits behind A
        deadline = time.monotonic() + 30
        while _waiting(c) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _waiting(c) == 1
        r = c.post("/v1/completions", json={"prompt": [11], "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        events.close()  # A disconnects -> aborted -> B runs
        t.join(60)
        assert result["r"].status_code == 200
        assert c.get("/health").status_code == 200


def test_sigterm_finishes_inflight_stream_and_exits_0(served):
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 250, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client(served, timeout=120) as c:
        events = _stream_events(c, body)
        next(events)
        served.proc.send_signal(signal.SIGTERM)
        rest = list(events)
    assert rest[-1] == "[DONE]"
    usage = json.loads(rest[-2])["usage"]
    assert usage["completion_tokens"] == 250
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in rest[:-2] if json.loads(e)["choices"]]
    assert finishes[-1] == "length"
    assert served.proc.wait(60) == 0, served.log()[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(served.url + "/health", timeout=5)
