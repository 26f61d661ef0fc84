"""Prometheus export of serving metrics, all named `roofline:<name>`, and vLLM's names beside them.

Each server gets its own `CollectorRegistry` (never the process-global one), so several servers or
tests in one process do not clash. `PrometheusStatLogger.record` is called from the engine thread;
prometheus_client metrics are thread-safe, and `/metrics` renders the registry from the event loop.

What a gateway reads (the Gateway API Inference Extension / llm-d endpoint picker, KEDA or an HPA through
prometheus-adapter) is vLLM's: `VLLM_MIRRORED` lists the metrics whose `roofline:` name is vLLM's name with
our prefix; `VllmMirror` renders each of them again as `vllm:<name>` at scrape time, from the same metric
objects (so the two names cannot disagree).  `lora_requests_info` (LoRA on) is vLLM's adapter gauge: labels
`max_lora`, `running_lora_adapters`, `waiting_lora_adapters` (comma-separated names), value the time of the
last update; one series at a time.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from roofline.metrics.stats import IterationStats, stat
from roofline.metrics.step_roofline import PHASES, RatioWindow

PREFIX = "roofline:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0)
STEP_TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1,
                     0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
STEP_BOUND_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02,
                      0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TOKEN_BUDGET_BUCKETS = tuple(float(2 ** i) for i in range(4, 17))  # 16 .. 65536 tokens
DRAFT_LENGTH_BUCKETS = tuple(float(k) for k in range(0, 17))
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 12.5, 15.0, 20.0,
                 25.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0)

# metrics exported a second time under vLLM's name (vllm:<name>): the ones vLLM's V1 engine exports
VLLM_MIRRORED = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds", "request_queue_time_seconds", "spec_decode_num_drafts",
                 "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos", "lora_requests_info")
VLLM_PREFIX = "vllm:"


class VllmMirror:
    """A collector rendering the given metrics (prometheus_client collectors named roofline:<name>) again as
    vllm:<name>, with the same samples."""

    def __init__(self, families: dict) -> None:
        self.families = families  # name (no prefix) -> the collector

    def describe(self) -> list:
        return []  # registered without a collect() at registration: the names are known to be distinct

    def collect(self):
        from prometheus_client.metrics_core import Metric

        for family in self.families.values():
            for metric in family.collect():
                mirror = Metric(VLLM_PREFIX + metric.name[len(PREFIX):], metric.documentation, metric.type)
                for sample in metric.samples:
                    mirror.add_sample(VLLM_PREFIX + sample.name[len(PREFIX):], sample.labels, sample.value,
                                      sample.timestamp, sample.exemplar)
                yield mirror


FINISH_REASONS = ("stop", "length", "abort", "error")
ROOFS = ("memory", "compute")


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None, lora: bool = False) -> None:
        """lora: the engine serves LoRA adapters (lora_requests_info is exported)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self._families: dict[str, Any] = {}  # name (no prefix) -> the collector, for VllmMirror

        def family(kind, name: str, doc: str, names=labels, **kwargs) -> Any:
            self._families[name] = kind(PREFIX + name, doc, names, registry=reg, **kwargs)
            return self._families[name]

        def hist(name: str, doc: str, buckets) -> Any:
            return family(Histogram, name, doc, buckets=buckets).labels(model_name)

        def gauge(name: str, doc: str) -> Any:
            return family(Gauge, name, doc).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return family(Counter, name, doc).labels(model_name)

        self._family = family
        self.lora_info = None
        if lora:
            self.lora_info = family(Gauge, "lora_requests_info", "LoRA adapters running and waiting (names, "
                                    "comma-separated); the value is the time of the update.",
                                    ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens, seconds.",
                        ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency from arrival to finish, seconds.",
                        REQUEST_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Per request: (e2e latency - TTFT) / (output tokens - 1), seconds.", TPOT_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds",
                               "Time from arrival to first scheduling, seconds.", REQUEST_BUCKETS)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction (0..1) of KV blocks held by requests.")
        self.num_total_blocks = gauge("kv_cache_num_blocks", "Total KV blocks in the pool.")
        self.num_free_blocks = gauge("kv_cache_num_free_blocks", "KV blocks not held by any request.")
        self.num_cached_blocks = gauge("kv_cache_num_cached_blocks",
                                       "Free KV blocks that still hold a reusable cached prefix.")
        self.weight_bytes = Gauge(PREFIX + "model_weight_bytes", "Bytes of the model's weights as its layers "
                                  "compute on them (GGUF blocks where kept, else dense), by format; rank 0.",
                                  ["model_name", "format"], registry=reg)

        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (prefilled).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.kv_received = counter("kv_transfer_received_bytes", "KV bytes loaded by the KV connector.")
        self.kv_sent = counter("kv_transfer_sent_bytes", "KV bytes the KV connector sent or stored.")
        success = family(Counter, "request_success", "Requests that left the engine, by finish reason.",
                         ["model_name", "finish_reason"])
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._success = success
        # Cumulative engine counters already exported, so each record() adds only the difference.
        self._last: dict[str, float] = {}
        self._init_step_roofline(reg)
        self._init_parallel(reg)
        self._init_spec_decode(reg)
        reg.register(VllmMirror({name: self._families[name] for name in VLLM_MIRRORED if name in self._families}))

    def _init_parallel(self, reg: CollectorRegistry) -> None:
        """Distributed runs: collectives per group and op (rank 0's), expert balance under EPLB."""
        coll = ["model_name", "group", "op"]
        self.collective_calls = Counter(PREFIX + "collective_calls", "Collectives the model issued on rank 0, by "
                                        "process group (tp, pp, dp, ep) and operation.", coll, registry=reg)
        self.collective_bytes = Counter(PREFIX + "collective_bytes", "Bytes rank 0 handed to collectives (to the "
                                        "other ranks, for all-to-all), by process group and operation.", coll,
                                        registry=reg)
        self.parallel_steps = Counter(PREFIX + "parallel_steps", "Engine steps of a distributed world (divide the "
                                      "collective counters by it for per-step figures).", ["model_name"],
                                      registry=reg).labels(self.model_name)
        self.expert_balancedness = Gauge(PREFIX + "expert_balancedness", "Mean / max tokens per expert-parallel "
                                         "rank over the EPLB window, per MoE layer, after the last rebalance.",
                                         ["model_name", "layer"], registry=reg)
        self.eplb_rebalances = Counter(PREFIX + "eplb_rebalances", "EPLB rebalances (expert weights moved).",
                                       ["model_name"], registry=reg).labels(self.model_name)
        dp = ["model_name", "dp_rank"]
        self.dp_running = Gauge(PREFIX + "dp_rank_num_requests_running", "Requests running on each data-parallel "
                                "rank (data-parallel attention).", dp, registry=reg)
        self.dp_waiting = Gauge(PREFIX + "dp_rank_num_requests_waiting", "Requests waiting on each data-parallel "
                                "rank.", dp, registry=reg)
        self.dp_requests = Counter(PREFIX + "dp_rank_requests", "User requests placed on each data-parallel rank.",
                                   dp, registry=reg)

    def _record_parallel(self, e: Any) -> None:
        for name, (calls, nbytes) in (getattr(e, "collectives", None) or {}).items():
            group, _, op = name.partition(".")
            for counter, value, key in ((self.collective_calls, calls, f"calls:{name}"),
                                        (self.collective_bytes, nbytes, f"bytes:{name}")):
                delta = value - self._last.get(key, 0)
                if delta > 0:
                    counter.labels(self.model_name, group, op).inc(delta)
                self._last[key] = value
        self._inc_from_cumulative(self.parallel_steps, e, "parallel_steps")
        self._inc_from_cumulative(self.eplb_rebalances, e, "eplb_rebalances")
        for layer, value in enumerate(getattr(e, "expert_balancedness", None) or []):
            self.expert_balancedness.labels(self.model_name, str(layer)).set(value)
        for rank, (running, waiting) in enumerate(zip(getattr(e, "data_parallel_running", None) or [],
                                                      getattr(e, "data_parallel_waiting", None) or [])):
            self.dp_running.labels(self.model_name, str(rank)).set(running)
            self.dp_waiting.labels(self.model_name, str(rank)).set(waiting)
        for rank, placed in enumerate(getattr(e, "data_parallel_requests", None) or []):
            key = f"dp_requests:{rank}"
            delta = placed - self._last.get(key, 0)
            if delta > 0:
                self.dp_requests.labels(self.model_name, str(rank)).inc(delta)
            self._last[key] = placed

    def _init_spec_decode(self, reg: CollectorRegistry) -> None:
        """Speculative decoding counters (vLLM's names): drafts verified, draft tokens, accepted tokens, and
        accepted tokens per draft position (position 0 = the first draft of a step)."""
        m, family = self.model_name, self._family
        self.spec_num_drafts = family(Counter, "spec_decode_num_drafts", "Request-steps that verified drafts.").labels(m)
        self.spec_num_draft_tokens = family(Counter, "spec_decode_num_draft_tokens", "Draft tokens verified.").labels(m)
        self.spec_num_accepted = family(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.").labels(m)
        self.spec_per_pos = family(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                   "Draft tokens accepted, by position in the step's drafts.", ["model_name", "position"])
        self._spec_last = None

    def _record_spec_decode(self, spec: Any) -> None:
        if spec is None:
            return
        last = self._spec_last
        d = spec.minus(last) if last is not None else spec
        self.spec_num_drafts.inc(d.num_drafts)
        self.spec_num_draft_tokens.inc(d.num_draft_tokens)
        self.spec_num_accepted.inc(d.num_accepted_tokens)
        for pos, n in enumerate(d.accepted_per_pos):
            if n > 0 or last is None:
                self.spec_per_pos.labels(self.model_name, str(pos)).inc(n)
        self._spec_last = spec.copy()

    def _init_step_roofline(self, reg: CollectorRegistry) -> None:
        """The live roofline (metrics/step_roofline.py): one observation per engine step."""
        m = self.model_name
        step_labels = ["model_name", "roof", "phase"]
        time_h = Histogram(PREFIX + "step_time_seconds", "Measured wall time of an engine step, seconds.",
                           step_labels, registry=reg, buckets=STEP_TIME_BUCKETS)
        bound_h = Histogram(PREFIX + "step_bound_seconds",
                            "Roofline bound of an engine step: max(bytes / bandwidth, FLOPs / peak), seconds.",
                            step_labels, registry=reg, buckets=STEP_BOUND_BUCKETS)
        ratio_h = Histogram(PREFIX + "step_ratio", "Per-step measured time / roofline bound.", step_labels,
                            registry=reg, buckets=RATIO_BUCKETS)
        steps = Counter(PREFIX + "steps", "Engine steps accounted by the live roofline.", step_labels, registry=reg)
        nbytes = Counter(PREFIX + "step_bytes_read", "Bytes engine steps had to read (weights touched, KV of "
                         "their context), by kind and binding roof.", ["model_name", "kind", "roof"], registry=reg)
        flops = Counter(PREFIX + "step_flops", "FLOPs engine steps did (linear layers and attention).",
                        ["model_name", "roof"], registry=reg)
        tokens = Counter(PREFIX + "step_tokens", "Tokens fed to engine steps, by kind (prefill chunks, decode).",
                         ["model_name", "kind"], registry=reg)
        ratio_g = Gauge(PREFIX + "step_roofline_ratio", "Median measured step time / roofline bound over the "
                        "last 64 steps (phase: all, prefill, decode, mixed).", ["model_name", "phase"], registry=reg)
        keys = [(roof, phase) for roof in ROOFS for phase in PHASES]
        self.step_time = {k: time_h.labels(m, *k) for k in keys}
        self.step_bound = {k: bound_h.labels(m, *k) for k in keys}
        self.step_ratio = {k: ratio_h.labels(m, *k) for k in keys}
        self.steps = {k: steps.labels(m, *k) for k in keys}
        self.step_bytes = {(kind, roof): nbytes.labels(m, kind, roof) for kind in ("weights", "kv") for roof in ROOFS}
        self.step_flops = {roof: flops.labels(m, roof) for roof in ROOFS}
        self.step_tokens = {kind: tokens.labels(m, kind) for kind in ("prefill", "decode")}
        self.step_ratio_gauge = ratio_g
        self.ratio_window = RatioWindow(64)
        # the scheduler's plan for each step (core/step_budget.py, core/step_time.py), beside what the step took
        predicted_h = Histogram(PREFIX + "step_predicted_seconds", "Step time the scheduler predicted for an engine "
                                "step as scheduled (roofline bound x measured ratio), seconds; compare "
                                "step_time_seconds.", step_labels, registry=reg, buckets=STEP_TIME_BUCKETS)
        self.step_predicted = {k: predicted_h.labels(m, *k) for k in keys}
        self.step_prediction_ratio = Gauge(PREFIX + "step_prediction_ratio", "Median measured step time / predicted "
                                           "step time over the last 64 steps (1: the estimate is right).",
                                           ["model_name"], registry=reg).labels(m)
        self.prediction_window: deque = deque(maxlen=64)
        self.step_token_budget = Histogram(PREFIX + "step_token_budget", "Token budget the ITL budget chose for an "
                                           "engine step (decode tokens + the prefill tokens allowed beside them; "
                                           "max_num_batched_tokens when no decode runs).", ["model_name"],
                                           registry=reg, buckets=TOKEN_BUDGET_BUCKETS).labels(m)
        self.step_target = Gauge(PREFIX + "step_target_seconds", "Step time the token budget aimed at for the last "
                                 "budgeted step (--target-itl-ms, or 1.25x the decodes' own time; 0: no decodes, the "
                                 "cap).", ["model_name"], registry=reg).labels(m)
        self.step_tail_margin = Gauge(PREFIX + "step_tail_margin", "The step-time model's tail margin after the last "
                                      "step: the 90th percentile of measured / predicted time of steps with prefill "
                                      "(>= 1); the token budget plans predicted x margin against its target.",
                                      ["model_name"], registry=reg).labels(m)
        self.step_draft_length = Histogram(PREFIX + "step_draft_length", "Speculative draft length the scheduler chose "
                                           "for an engine step.", ["model_name"], registry=reg,
                                           buckets=DRAFT_LENGTH_BUCKETS).labels(m)

    def _record_steps(self, records: Any) -> None:
        if not records:
            return
        for r in records:
            roof = r.roof
            key = (roof, r.phase)
            self.step_time[key].observe(r.step_time_s)
            self.step_bound[key].observe(r.bound_s)
            if r.bound_s > 0:
                self.step_ratio[key].observe(r.ratio)
            self.steps[key].inc()
            self.step_bytes[("weights", roof)].inc(r.weight_bytes)
            self.step_bytes[("kv", roof)].inc(r.kv_bytes)
            self.step_flops[roof].inc(r.flops)
            self.step_tokens["prefill"].inc(r.prefill_tokens)
            self.step_tokens["decode"].inc(r.decode_tokens)
            self.ratio_window.add(r)
            self._record_plan(r, key)
        for phase, value in self.ratio_window.medians().items():
            self.step_ratio_gauge.labels(self.model_name, phase).set(value)
        if self.prediction_window:
            self.step_prediction_ratio.set(statistics.median(self.prediction_window))

    def _record_plan(self, r: Any, key: tuple) -> None:
        """What the scheduler planned for the step (records made without a plan carry none of it)."""
        predicted = getattr(r, "predicted_s", 0.0)
        if predicted > 0:
            self.step_predicted[key].observe(predicted)
            self.prediction_window.append(r.step_time_s / predicted)
        if getattr(r, "token_budget", 0) > 0:
            self.step_token_budget.observe(r.token_budget)
            self.step_target.set(r.target_s)
        if getattr(r, "tail_margin", 0.0) > 0:
            self.step_tail_margin.set(r.tail_margin)
        if getattr(r, "draft_length", -1) >= 0:
            self.step_draft_length.observe(r.draft_length)

    def _inc_from_cumulative(self, counter: Any, engine_stats: Any, field: str) -> None:
        value = stat(engine_stats, field)
        delta = value - self._last.get(field, 0)
        if delta > 0:
            counter.inc(delta)
        self._last[field] = value

    def record(self, stats: IterationStats) -> None:
        for v in stats.ttfts:
            self.ttft.observe(v)
        for v in stats.itls:
            self.itl.observe(v)
        for f in stats.finished:
            self.e2e.observe(f.e2e_latency)
            if f.ttft is not None and f.num_generation_tokens > 1:
                self.tpot.observe((f.e2e_latency - f.ttft) / (f.num_generation_tokens - 1))
            if f.queue_time is not None:
                self.queue_time.observe(f.queue_time)
            child = self.request_success.get(f.finish_reason)
            if child is None:
                child = self.request_success[f.finish_reason] = self._success.labels(self.model_name,
                                                                                     f.finish_reason)
            child.inc()
        e = stats.engine
        if e is None:
            return
        self.num_running.set(stat(e, "num_running"))
        self.num_waiting.set(stat(e, "num_waiting"))
        self.kv_usage.set(stat(e, "kv_cache_usage"))
        self.num_total_blocks.set(stat(e, "num_total_blocks"))
        self.num_free_blocks.set(stat(e, "num_free_blocks"))
        self.num_cached_blocks.set(stat(e, "num_cached_blocks"))
        for fmt, n in (getattr(e, "weight_bytes", None) or {}).items():
            self.weight_bytes.labels(self.model_name, fmt).set(n)
        self._inc_from_cumulative(self.prefix_queries, e, "prefix_cache_queries")
        self._inc_from_cumulative(self.prefix_hits, e, "prefix_cache_hits")
        self._inc_from_cumulative(self.preemptions, e, "num_preemptions")
        self._inc_from_cumulative(self.prompt_tokens, e, "prompt_tokens")
        self._inc_from_cumulative(self.generation_tokens, e, "generation_tokens")
        self._inc_from_cumulative(self.kv_received, e, "kv_transfer_bytes_received")
        self._inc_from_cumulative(self.kv_sent, e, "kv_transfer_bytes_sent")
        self._record_steps(getattr(e, "step_roofline", None))
        self._record_parallel(e)
        self._record_spec_decode(getattr(e, "spec_decode", None))
        self._record_lora(e)

    def _record_lora(self, e: Any) -> None:
        if self.lora_info is None:
            return
        labels = (str(int(stat(e, "max_lora"))), ",".join(getattr(e, "running_lora_adapters", None) or []),
                  ",".join(getattr(e, "waiting_lora_adapters", None) or []))
        if labels != getattr(self, "_lora_labels", None):
            self.lora_info.clear()  # one series: the current adapters
            self._lora_labels = labels
        self.lora_info.labels(*labels).set_to_current_time()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text exposition into {"name{labels}": value} (for tests and the benchmark)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def metric_value(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 if none)."""
    total, found = 0.0, False
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
            found = True
    return total if found else 0.0


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile on cumulative (upper bound, count) pairs: linear within the bucket."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def step_roofline_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """The live roofline between two /metrics scrapes, per phase (and "all"): steps, median ratio
    (from the roofline:step_ratio histogram), mean step and bound (ms), share of memory-bound steps."""
    out: dict[str, dict[str, float]] = {}
    for phase in ("all",) + PHASES:
        sel = {} if phase == "all" else {"phase": phase}
        d = {n: metric_value(after, PREFIX + n, **sel) - metric_value(before, PREFIX + n, **sel)
             for n in ("steps_total", "step_time_seconds_sum", "step_bound_seconds_sum")}
        steps = d["steps_total"]
        if steps <= 0:
            continue
        mem = (metric_value(after, PREFIX + "steps_total", roof="memory", **sel)
               - metric_value(before, PREFIX + "steps_total", roof="memory", **sel))
        les = {k.split('le="')[1].split('"')[0] for k in after if k.startswith(PREFIX + "step_ratio_bucket")}
        buckets = [(float(le), metric_value(after, PREFIX + "step_ratio_bucket", le=le, **sel)
                    - metric_value(before, PREFIX + "step_ratio_bucket", le=le, **sel)) for le in les]
        out[phase] = {"steps": steps, "median_ratio": histogram_quantile(0.5, buckets),
                      "mean_step_ms": 1e3 * d["step_time_seconds_sum"] / steps,
                      "mean_bound_ms": 1e3 * d["step_bound_seconds_sum"] / steps, "memory_bound_share": mem / steps}
    return out
