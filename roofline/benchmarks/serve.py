"""`roofline bench serve`: online serving benchmark (BENCHMARKS.md, W2) against any OpenAI-compatible
server.

Requests go to `/v1/completions` with `stream=true`, the prompt as a list of token ids (exact
lengths), greedy, `ignore_eos` and `max_tokens` = the sampled output length. Arrivals are Poisson at
`--request-rate` (or all at once for `inf`), optionally capped at `--max-concurrency` in flight.

Per request: TTFT (send -> first streamed text), TPOT ((latency - TTFT) / (output tokens - 1)), the
gaps between streamed chunks (ITL) and the end-to-end latency. Reported: mean, median and p99 of
each, request / output-token / total-token throughput, and goodput (requests per second that met
every SLO given with `--goodput ttft:MS tpot:MS e2el:MS`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from roofline.benchmarks.datasets import (
    SampleRequest,
    arrival_times,
    random_requests,
    sharegpt_requests,
    shared_prefix_requests,
)

logger = logging.getLogger(__name__)

SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "latency", "e2e": "latency"}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    expected_output_len: int = 0
    output_len: int = 0
    ttft: Optional[float] = None  # seconds
    latency: float = 0.0  # seconds, send -> last byte
    itls: list[float] = field(default_factory=list)  # seconds between consecutive content chunks
    start_time: float = 0.0  # seconds since the benchmark start
    chunk_times: list[float] = field(default_factory=list)  # seconds since the benchmark start
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: Optional[str] = None
    api_key: Optional[str] = None
    request_rate: float = float("inf")
    max_concurrency: Optional[int] = None
    seed: int = 0
    ignore_eos: bool = True
    num_warmups: int = 1
    timeout: float = 3600.0
    disable_tqdm: bool = False
    goodput: dict[str, float] = field(default_factory=dict)  # "ttft"/"tpot"/"latency" -> seconds


# --------------------------------------------------------------------------- one request
async def send_request(client: Any, cfg: BenchConfig, model: str, req: SampleRequest, t0: float) -> RequestResult:
    payload = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len)
    start = time.perf_counter()
    res.start_time = start - t0
    last = start
    chunks = 0
    usage_tokens: Optional[int] = None
    try:
        async with client.stream("POST", cfg.base_url.rstrip("/") + cfg.endpoint, json=payload,
                                 headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = str(obj["error"])[:300]
                    return res
                now = time.perf_counter()
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                choices = obj.get("choices") or []
                # A chunk is a token event unless it only marks the end (no text, a finish_reason).
                if any(c.get("text") or not c.get("finish_reason") for c in choices):
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    res.chunk_times.append(now - t0)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        res.output_len = usage_tokens if usage_tokens is not None else chunks
        res.success = res.ttft is not None or res.output_len == 0
        if not res.success:
            res.error = "no tokens received"
    except Exception as e:  # network errors, malformed streams
        res.error = f"{type(e).__name__}: {e}"
        res.latency = time.perf_counter() - start
    return res


# --------------------------------------------------------------------------- the run
async def _discover(client: Any, cfg: BenchConfig) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    r = await client.get(cfg.base_url.rstrip("/") + "/v1/models", headers=headers)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{cfg.base_url}/v1/models lists no model")
    return data[0]


async def fetch_model_card(cfg: BenchConfig) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=30.0) as client:
        return await _discover(client, cfg)


async def run_requests(cfg: BenchConfig, requests: Sequence[SampleRequest],
                       model: Optional[str] = None) -> tuple[list[RequestResult], float]:
    """Send the requests per the config; returns the results (in request order) and the duration."""
    import httpx

    limit = cfg.max_concurrency or len(requests) or 1
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(cfg.timeout, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if model is None:
            model = cfg.model or (await _discover(client, cfg))["id"]
        for _ in range(cfg.num_warmups):
            if requests:
                w = requests[0]
                warm = SampleRequest(w.prompt[:16] if isinstance(w.prompt, list) else w.prompt,
                                     min(16, w.prompt_len), 4)
                r = await send_request(client, cfg, model, warm, time.perf_counter())
                if not r.success:
                    raise RuntimeError(f"warm-up request failed: {r.error}")

        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        times = arrival_times(len(requests), cfg.request_rate, cfg.seed)
        bar = None
        if not cfg.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req")
        t0 = time.perf_counter()

        async def one(i: int, req: SampleRequest) -> RequestResult:
            delay = t0 + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                res = await send_request(client, cfg, model, req, t0)
            else:
                async with sem:
                    res = await send_request(client, cfg, model, req, t0)
            if bar is not None:
                bar.update(1)
            return res

        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    return list(results), duration


# --------------------------------------------------------------------------- metrics
def scrape_metrics(cfg: BenchConfig) -> Optional[dict[str, float]]:
    """The server's /metrics, parsed; None when it has none (another engine, a proxy)."""
    import httpx

    from roofline.metrics.prometheus import parse_metrics

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    try:
        r = httpx.get(cfg.base_url.rstrip("/") + "/metrics", headers=headers, timeout=30.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(r.text) if r.status_code == 200 else None


def live_roofline(before: Optional[dict[str, float]], after: Optional[dict[str, float]]) -> Optional[dict]:
    """Per-phase step-vs-bound figures of the benchmark's steps, from the server's roofline:step_* metrics."""
    from roofline.metrics.prometheus import step_roofline_delta

    if before is None or after is None:
        return None
    return step_roofline_delta(before, after)


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    import numpy as np

    if len(values) == 0:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    v = np.asarray(values, dtype=float) * 1000.0
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p99": float(np.percentile(v, 99))}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    for key, limit in slo.items():
        value = r.latency if key == "latency" else getattr(r, key)
        if value is None or value > limit:
            if key == "tpot" and value is None and r.success:  # a 1-token answer has no TPOT
                continue
            return False
    return True


def compute_metrics(results: Sequence[RequestResult], duration: float,
                    goodput: Optional[dict[str, float]] = None) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    duration = max(duration, 1e-9)
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "expected_output_tokens": sum(r.expected_output_len for r in ok),
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "e2el_ms": _stats_ms([r.latency for r in ok]),
    }
    if goodput:
        good = sum(1 for r in ok if meets_slo(r, goodput))
        m["goodput_slo_ms"] = {k: v * 1000.0 for k, v in goodput.items()}
        m["good_requests"] = good
        m["goodput"] = good / duration
    errors = [r.error for r in results if not r.success]
    if errors:
        m["errors"] = errors[:10]
    return m


def format_report(m: dict[str, Any], title: str = "Serving benchmark") -> str:
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value: Any, fmt: str = "{:.2f}") -> None:
        text = fmt.format(value) if isinstance(value, float) else str(value)
        lines.append(f"{label:<34}{text:>{w - 34}}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    if "goodput" in m:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in m["goodput_slo_ms"].items())
        row(f"Goodput (req/s) [{slo}]:" if len(slo) < 20 else "Goodput (req/s):", m["goodput"])
        if len(slo) >= 20:
            lines.append(f"  SLO: {slo}")
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                      ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{' ' + name + ' ':-^{w}}")
        s = m[key]
        row(f"Mean {key.split('_')[0].upper()} (ms):", s["mean"])
        row(f"Median {key.split('_')[0].upper()} (ms):", s["median"])
        row(f"P99 {key.split('_')[0].upper()} (ms):", s["p99"])
    lines.append("=" * w)
    if m.get("live_roofline") is not None:
        from roofline.metrics.step_roofline import format_phase_medians

        lines.append(format_phase_medians(m["live_roofline"]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def parse_range(text: str) -> tuple[int, int]:
    """"N" or "MIN:MAX" -> (min, max)."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            lo, hi = int(a), int(b)
        else:
            lo = hi = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}")
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"invalid range {text!r}")
    return lo, hi


def parse_rate(text: str) -> float:
    if text.lower() in ("inf", "infinity"):
        return float("inf")
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a rate in requests/s or 'inf', got {text!r}")
    if v <= 0:
        raise argparse.ArgumentTypeError("the request rate must be positive")
    return v


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:1000", "tpot:100"] (milliseconds) -> {"ttft": 1.0, "tpot": 0.1} (seconds)."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key.lower() not in SLO_KEYS:
            raise ValueError(f"invalid --goodput item {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"invalid --goodput value in {item!r}: not a number")
        slo[SLO_KEYS[key.lower()]] = ms / 1000.0
    return slo


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default: %(default)s)")
    p.add_argument("--endpoint", default="/v1/completions", help="completions route (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token for the server (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset-name", choices=["random", "shared-prefix", "sharegpt"], default=None,
                   help="workload (default: random, or sharegpt when --dataset-path is given)")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    p.add_argument("--num-prompts", type=int, default=64, help="number of requests (default: 64, as W2)")
    p.add_argument("--random-input-len", type=parse_range, default=(64, 256), metavar="MIN:MAX",
                   help="random dataset prompt lengths (default: 64:256, as W2)")
    p.add_argument("--random-output-len", type=parse_range, default=(32, 256), metavar="MIN:MAX",
                   help="random dataset output lengths (default: 32:256, as W2)")
    p.add_argument("--shared-prefix-len", type=int, default=512, help="shared-prefix: common prefix tokens")
    p.add_argument("--shared-suffix-len", type=int, default=32, help="shared-prefix: unique suffix tokens")
    p.add_argument("--shared-output-len", type=int, default=32, help="shared-prefix: output tokens")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: fixed output length (default: the reply's length)")
    p.add_argument("--tokenizer", default=None,
                   help="sharegpt: local tokenizer directory (default: the server's /tokenize)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary size for random token ids (default: from /v1/models, else 49000+)")
    p.add_argument("--seed", type=int, default=None,
                   help="dataset seed (default: 0; 1 for shared-prefix, as W3); arrivals use it too (default 0)")
    p.add_argument("--request-rate", type=parse_rate, default=float("inf"),
                   help="Poisson arrival rate in requests/s, or inf to send all at once (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore EOS, exact output lengths)")
    p.add_argument("--num-warmups", type=int, default=1, help="short warm-up requests first (default: 1)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:1000 tpot:100 (e2el:MS too)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw latency distributions and throughput over time")
    p.add_argument("--save-result", nargs="?", const="", default=None, metavar="JSON",
                   help="write results as JSON (default file: bench-results/serve-<time>.json)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout, seconds")


def build_requests(args: argparse.Namespace, cfg: BenchConfig, card: dict) -> list[SampleRequest]:
    name = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    vocab = args.vocab_size if args.vocab_size is not None else card.get("vocab_size")
    if name == "random":
        seed = 0 if args.seed is None else args.seed
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, seed, vocab)
    if name == "shared-prefix":
        seed = 1 if args.seed is None else args.seed
        return shared_prefix_requests(args.num_prompts, args.shared_prefix_len, args.shared_suffix_len,
                                      args.shared_output_len, seed, vocab)
    if not args.dataset_path:
        raise SystemExit("--dataset-name sharegpt needs --dataset-path FILE")
    max_len = int(card.get("max_model_len") or 2048)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)

        def tokenize(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)
    else:
        import httpx

        client = httpx.Client(timeout=60.0)
        url = cfg.base_url.rstrip("/") + "/tokenize"

        def tokenize(text: str) -> list[int]:
            r = client.post(url, json={"prompt": text, "add_special_tokens": False})
            if r.status_code != 200:
                raise SystemExit(f"{url} failed ({r.status_code}): give --tokenizer DIR instead")
            return r.json()["tokens"]

    seed = 0 if args.seed is None else args.seed
    return sharegpt_requests(args.dataset_path, args.num_prompts, tokenize, seed,
                             max_prompt_len=min(1024, max_len - 4), max_total_len=min(2048, max_len),
                             fixed_output_len=args.sharegpt_output_len)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from roofline.config import env_flag

    return BenchConfig(
        base_url=args.base_url, endpoint=args.endpoint, model=args.model,
        api_key=args.api_key if args.api_key is not None else (env_flag("OPENAI_API_KEY") or None),
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        seed=0 if args.seed is None else args.seed, ignore_eos=args.ignore_eos, num_warmups=args.num_warmups,
        timeout=args.timeout, disable_tqdm=args.disable_tqdm, goodput=parse_goodput(args.goodput),
    )


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per request
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"roofline bench serve: {e}")
    card = asyncio.run(fetch_model_card(cfg))
    model = cfg.model or card["id"]
    requests = build_requests(args, cfg, card)
    rate = "inf" if cfg.request_rate == float("inf") else f"{cfg.request_rate:g} req/s"
    print(f"benchmarking {model} at {cfg.base_url}: {len(requests)} requests, rate {rate}, "
          f"max concurrency {cfg.max_concurrency or 'unlimited'}")
    before = scrape_metrics(cfg)
    results, duration = asyncio.run(run_requests(cfg, requests, model))
    metrics = compute_metrics(results, duration, cfg.goodput)
    metrics["live_roofline"] = live_roofline(before, scrape_metrics(cfg))
    print(format_report(metrics))
    if metrics["failed"]:
        print(f"first errors: {metrics.get('errors', [])[:3]}")
    if args.plot:
        from roofline.benchmarks.plots import plot_benchmark

        plot_benchmark(args.plot, results, duration, title=f"{model}: {len(requests)} requests, rate {rate}")
        print(f"plot written to {args.plot}")
    if args.save_result is not None:
        path = args.save_result or os.path.join("bench-results", time.strftime("serve-%Y%m%d-%H%M%S.json"))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        doc = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "model": model,
            "base_url": cfg.base_url,
            "config": {k: v for k, v in vars(args).items() if k != "func" and not callable(v)},
            "metrics": metrics,
            "requests": [{**asdict(r), "tpot": r.tpot} for r in results],
        }
        with open(path, "w") as f:
            json.dump(_json_safe(doc), f, indent=1)
        print(f"results written to {path}")
    return 0 if metrics["completed"] > 0 else 1


def register(bench_subparsers: Any) -> None:
    """Add `serve` to `roofline bench`'s subcommands."""
    p = bench_subparsers.add_parser(
        "serve", help="online serving benchmark against an OpenAI-compatible server (W2)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    p.set_defaults(func=run)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m roofline.benchmarks.serve ...` (same as `roofline bench serve ...`)."""
    parser = argparse.ArgumentParser(prog="roofline bench")
    sub = parser.add_subparsers(dest="bench_command", required=True)
    register(sub)
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
