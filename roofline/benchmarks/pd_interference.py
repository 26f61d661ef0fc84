"""`roofline bench w8`: W8 (BENCHMARKS.md), W4's interference test with prefill and decode disaggregated.

16 requests decode (prompt 64, output 256, streamed); once each has 32 tokens, one 2048-token prompt
arrives.  Measured at the client, per decoder, the gaps between its streamed tokens: p99 and max while
the long prompt prefills (from its arrival to its first token) against the same figures over an
equally long window just before it arrived; and the long request's TTFT.  Layouts, each its own
`roofline serve` process(es), pinned with taskset:
  colocated_chunked    one engine on every core, max_num_batched_tokens 256
  colocated_unchunked  one engine on every core, max_num_batched_tokens 4096 (the prompt in one step)
  pd                   a prefill engine on core 0, a decode engine on core 1 (P2pConnector), behind
                       `roofline router`
Also reported for PD: the KV bytes the decode engine received, against the planner's prediction
(the blocks of every prompt token but the last, planner/disagg.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import httpx

from roofline.benchmarks.datasets import random_requests

READY = re.compile(r"(?:serving model '[^']+'|router \(.*\)) on (http://[\d.]+:\d+)")
LAYOUTS = ("colocated_chunked", "colocated_unchunked", "pd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Proc:
    """A roofline subcommand in its own process (optionally pinned to cores), ready once it logs its URL."""

    def __init__(self, args: list[str], cores: Optional[str]) -> None:
        env = dict(os.environ)
        if cores is not None:
            env["OMP_NUM_THREADS"] = str(len(cores.split(",")))
        cmd = ([*(["taskset", "-c", cores] if cores else [])] + [sys.executable, "-m", "roofline.entrypoints.cli"]
               + args)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url: Optional[str] = None
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def wait(self, timeout: float = 300) -> str:
        self._ready.wait(timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError("process did not start:\n" + "".join(self.lines[-30:]))
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serve_args(args: argparse.Namespace, port: int, budget: int, kv: Optional[dict] = None) -> list[str]:
    out = ["serve", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096", "--kv-cache-memory",
           str(args.kv_cache_memory), "--max-num-batched-tokens", str(budget), "--no-step-roofline",
           "--uvicorn-log-level", "warning", "--disable-access-log", "--log-stats-interval", "0"]
    if args.model:
        out += ["--model", args.model]
    if kv is not None:
        out += ["--kv-transfer-config", json.dumps(kv)]
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                  times: list[float]) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                if any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices", [])):
                    times.append(time.monotonic())


async def _interference(url: str, vocab: Optional[int] = None) -> dict[str, Any]:
    decoders = random_requests(16, (64, 64), (256, 256), seed=0, vocab_size=vocab)
    long_req = random_requests(1, (2048, 2048), (16, 16), seed=1, vocab_size=vocab)[0]
    async with httpx.AsyncClient(timeout=600) as client:
        await _stream(client, url, decoders[0].prompt[:16], 4, [])  # warm-up
        times: list[list[float]] = [[] for _ in decoders]
        tasks = [asyncio.ensure_future(_stream(client, url, r.prompt, 256, t)) for r, t in zip(decoders, times)]
        while min(len(t) for t in times) < 32:
            if any(t.done() and t.exception() for t in tasks):
                await asyncio.gather(*tasks)
            await asyncio.sleep(0.002)
        arrived = time.monotonic()
        long_times: list[float] = []
        await _stream(client, url, long_req.prompt, 16, long_times)
        await asyncio.gather(*tasks)
    first = long_times[0]
    window = first - arrived
    during, before = [], []
    for t in times:
        for a, b in zip(t, t[1:]):
            if arrived <= b <= first:
                during.append(b - a)
            elif arrived - window <= b < arrived:
                before.append(b - a)
    p99_during, p99_before = _percentile(during, 0.99), _percentile(before, 0.99)
    return {"ttft_long_s": window, "p99_itl_during_ms": 1e3 * p99_during, "max_itl_during_ms": 1e3 * max(during or [0]),
            "p99_itl_before_ms": 1e3 * p99_before, "max_itl_before_ms": 1e3 * max(before or [0]),
            "p99_ratio_during_over_before": p99_during / p99_before if before else float("nan"),
            "itl_samples_during": len(during), "itl_samples_before": len(before)}


def _received_bytes(url: str) -> float:
    from roofline.metrics.prometheus import metric_value, parse_metrics

    return metric_value(parse_metrics(httpx.get(url + "/metrics").text), "roofline:kv_transfer_received_bytes_total")


def run_layout(args: argparse.Namespace, layout: str) -> dict[str, Any]:
    procs: list[Proc] = []
    try:
        if layout.startswith("colocated"):
            budget = 256 if layout == "colocated_chunked" else 4096
            procs.append(Proc(_serve_args(args, _free_port(), budget), args.all_cores))
            url = procs[0].wait()
            res = asyncio.run(_interference(url))
        else:
            kv_port = _free_port()
            consumer_extra = {} if args.max_pull_share is None else {"max_pull_share": args.max_pull_share}
            pre = Proc(_serve_args(args, _free_port(), 2048, {"kv_connector": "P2pConnector", "kv_role": "kv_producer",
                                                               "kv_port": kv_port}), args.prefill_core)
            dec = Proc(_serve_args(args, _free_port(), 2048, {"kv_connector": "P2pConnector", "kv_role": "kv_consumer",
                                                               "kv_connector_extra_config": consumer_extra}),
                       args.decode_core)
            procs += [pre, dec]
            p_url, d_url = pre.wait(), dec.wait()
            router = Proc(["--log-level", "INFO", "router", "--prefill", p_url, "--decode", d_url, "--port",
                           str(_free_port())], None)
            procs.append(router)
            url = router.wait()
            res = asyncio.run(_interference(url))
            res["kv_bytes_received"] = _received_bytes(d_url)
        res["layout"] = layout
        return res
    finally:
        for p in reversed(procs):
            p.stop()


def predicted_kv_bytes(model: Optional[str], prompt_lens: list[int], block_size: int = 16) -> float:
    """The planner's KV bytes per request (the blocks of every prompt token but the last), summed."""
    from roofline.planner.cost_model import PlanInputs
    from roofline.planner.disagg import transferred_kv_bytes
    from roofline.planner.hardware import get_hardware
    from roofline.planner.model_specs import load_model_spec

    p = PlanInputs(load_model_spec(model), get_hardware("h100-sxm"), weight_dtype="fp32", kv_dtype="fp32",
                   block_size=block_size)
    return sum(transferred_kv_bytes(p, n) for n in prompt_lens)


def run(args: argparse.Namespace) -> int:
    layouts = LAYOUTS if args.layout == "all" else (args.layout,)
    results = [run_layout(args, layout) for layout in layouts]
    for r in results:
        if r["layout"] == "pd":  # warm-up (16 tokens) + 16 decoders (64) + the long prompt (2048)
            r["kv_bytes_predicted"] = predicted_kv_bytes(args.model, [16] + [64] * 16 + [2048])
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        print(f"{r['layout']:>20}: decoders' p99 ITL {r['p99_itl_before_ms']:.1f} ms before the long prompt, "
              f"{r['p99_itl_during_ms']:.1f} ms while it prefills (x{r['p99_ratio_during_over_before']:.2f}; "
              f"max {r['max_itl_during_ms']:.1f} ms); long TTFT {r['ttft_long_s']:.2f} s")
        if "kv_bytes_received" in r:
            print(f"{'':>20}  KV received {r['kv_bytes_received'] / 2**20:.1f} MiB, planner predicts "
                  f"{r['kv_bytes_predicted'] / 2**20:.1f} MiB")
    return 0


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser("w8", help="W8: long-prompt interference, prefill/decode disaggregated vs colocated",
                                    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=[*LAYOUTS, "all"], default="all")
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--all-cores", default="0,1", help="colocated engine's cores (taskset list, default 0,1)")
    p.add_argument("--prefill-core", default="0", help="PD: the prefill engine's cores (default 0)")
    p.add_argument("--decode-core", default="1", help="PD: the decode engine's cores (default 1)")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="KV pool bytes per engine (default 1 GiB)")
    p.add_argument("--max-pull-share", type=float, default=None,
                   help="PD: the decode engine's P2P pull pacing (kv_connector_extra_config max_pull_share; "
                        "default: the connector's, 0.25; 1 pulls flat out)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)
