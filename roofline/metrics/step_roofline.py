"""The live roofline: every engine step measured against its physical bound.

`StepRooflineModel` turns one step's SchedulerOutput into the bytes the step had to read and the
FLOPs it had to do, with the planner's cost model (roofline/planner/cost_model.py) and nothing
else, and divides them by the device's bandwidth and peak FLOP/s::

    tokens N      = sum of the new tokens of every scheduled request
    weights read  = decode_weight_bytes_read(N)       (all weights once; an MoE its touched experts)
    KV read       = sum over requests of ModelSpec.kv_bytes_read(positions after the step, its new tokens)
    FLOPs         = (2 * active_params * N + sum over requests of ModelSpec.attention_flops_over(its new
                    tokens)) / tp
    bound         = max(bytes / BW, FLOPs / F_peak)   (the planner's decode_step_time, overhead 0)
    ratio         = measured step wall time / bound;  roof = "memory" | "compute"

A new token at position j (0-based) attends to j + 1 positions -- in a sliding-window layer (Gemma 2/3,
gpt-oss, Mistral) to min(j + 1, window) of them, and a request's step reads in such a layer only the
union of its new tokens' windows: the ModelSpec functions the planner uses count both, so a decode step
of `b` sequences at context S and a prefill of an n-token prompt give exactly the planner's
`decode_at(b, S)` and `prefill(n)` figures (tests/metrics/test_step_roofline.py holds them equal). The
cost per step is a
loop over the scheduled requests (not over tokens) and a few multiplications: no device sync, no
tensor touched. The bound has no per-step overhead term: what the framework costs beyond bytes and
FLOPs is exactly what the ratio shows.

Hardware (`resolve_hardware`): a named planner preset when given; on CUDA the preset matching the
device name (datasheet figures); otherwise (the CPU, an unknown GPU) bandwidth and FLOP/s measured
once per process at start-up with the planner's own probes (a tensor copy and a square matmul, sized
to take about a second at most), the fastest of three runs of each: a roof is the best the device
does, and on a shared machine a single probe can land in a neighbour's time slice.

`StepRoofline` is one step's record (a msgspec Struct, so it travels with EngineStats across a
process boundary); `phase_medians` summarises a list of them per phase for the benchmarks.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from typing import Any, Iterable, Optional

import msgspec

from roofline.planner.cost_model import PlanInputs, decode_step_time, decode_weight_bytes_read, kv_bytes_per_token
from roofline.planner.hardware import GPU_PRESETS, HardwareSpec, get_hardware, normalize_dtype
from roofline.planner.model_specs import ModelSpec

logger = logging.getLogger(__name__)

PHASES = ("prefill", "decode", "mixed")


def is_decode(new_tokens: int, draft_tokens: int = 0) -> bool:
    """A scheduled request fed one token, or a decode verifying drafts (speculative decoding): a decode's row(s);
    anything longer is a prefill chunk."""
    return new_tokens == 1 or new_tokens - draft_tokens == 1


class StepRoofline(msgspec.Struct, array_like=True):
    """One engine step against its bound."""

    timestamp: float  # time.monotonic() at the end of the step
    step_time_s: float  # measured wall time of the step (schedule -> outputs)
    bound_s: float  # max(memory_s, compute_s)
    memory_s: float  # bytes_read / bandwidth
    compute_s: float  # flops / peak FLOP/s
    weight_bytes: float
    kv_bytes: float
    flops: float
    prefill_tokens: int  # new tokens of requests fed more than one token this step
    decode_tokens: int  # requests fed exactly one token
    num_requests: int
    kv_cache_usage: float  # fraction of KV blocks held after the step
    # what the scheduler planned (core/step_budget.py, core/step_time.py): the step time it predicted for the
    # step as scheduled (the bound times the measured ratio; 0.0: no estimate kept), the token budget the ITL
    # budget chose (0: none, max_num_batched_tokens alone), the step time that budget aimed at (0.0: none, or
    # no decodes to protect), the speculative draft length (-1: no speculation), the step-time model's tail
    # margin after the step (core/step_time.TailMargin: the budget plans predicted x margin; 0.0: no estimate)
    predicted_s: float = 0.0
    token_budget: int = 0
    target_s: float = 0.0
    draft_length: int = -1
    tail_margin: float = 0.0

    @property
    def bytes_read(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def ratio(self) -> float:
        return self.step_time_s / self.bound_s if self.bound_s > 0 else math.inf

    @property
    def roof(self) -> str:
        """The roof that binds: "compute" when FLOPs take longer than the bytes, else "memory"."""
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def phase(self) -> str:
        """ "decode" (every request fed one token), "prefill" (prefill tokens are at least half the
        step's tokens: prefill-heavy), else "mixed"."""
        if self.prefill_tokens == 0:
            return "decode"
        return "prefill" if self.prefill_tokens >= self.decode_tokens else "mixed"

    def bound_on(self, bandwidth: float, peak_flops: float) -> float:
        """The step's bound on other hardware figures (same bytes and FLOPs): max(bytes / BW, FLOPs / F)."""
        return max(self.bytes_read / bandwidth, self.flops / peak_flops if peak_flops else 0.0)


class StepRooflineModel:
    """Per-step bytes, FLOPs and bound for one model on one device (the planner's cost model)."""

    def __init__(self, spec: ModelSpec, hardware: HardwareSpec, weight_dtype: str, kv_dtype: Optional[str] = None,
                 tp: int = 1) -> None:
        self.plan = PlanInputs(spec, hardware, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
        self.spec, self.hardware, self.tp = spec, hardware, tp
        self.bandwidth = hardware.hbm_bandwidth
        self.peak_flops = self.plan.peak_flops
        self.kv_bytes_per_token = kv_bytes_per_token(self.plan)
        self.linear_flops_per_token = 2.0 * spec.active_params()
        self._dense_weight_bytes = None if spec.is_moe else decode_weight_bytes_read(self.plan, 1)

    def use_weight_bytes(self, nbytes: float) -> None:
        """The weights as loaded read `nbytes` a step instead of params x dtype size (a dense model whose
        layers stay in GGUF blocks: --gguf-weights native); MoE models keep the planner's count."""
        if self._dense_weight_bytes is not None:
            self._dense_weight_bytes = float(nbytes)

    def weight_bytes_read(self, num_tokens: int) -> float:
        if self._dense_weight_bytes is not None:
            return self._dense_weight_bytes
        return decode_weight_bytes_read(self.plan, num_tokens)

    def account(self, scheduled: Iterable[Any], step_time_s: float, timestamp: float = 0.0,
                kv_cache_usage: float = 0.0) -> StepRoofline:
        """The record of one step from its scheduled requests (`num_computed_tokens`, `token_ids`)."""
        n_tokens = prefill_tokens = decode_tokens = n_req = 0
        kv_bytes = attn_flops = 0.0
        for s in scheduled:
            c = len(s.token_ids)
            if c == 0:
                continue
            start = s.num_computed_tokens
            n_req += 1
            n_tokens += c
            phase = "decode" if is_decode(c, getattr(s, "num_draft_tokens", 0)) else "prefill"
            if phase == "decode":
                decode_tokens += c
            else:
                prefill_tokens += c
            kv, attn = self.request_cost(start, c, phase)
            kv_bytes += kv
            attn_flops += attn
        return self.record(n_tokens, kv_bytes, attn_flops, prefill_tokens, decode_tokens, n_req, step_time_s,
                           timestamp, kv_cache_usage)

    def request_cost(self, start: int, new_tokens: int, phase: str) -> tuple[float, float]:
        """(KV bytes read, attention FLOPs before the tp split) of one request's `new_tokens` tokens after
        `start` computed ones: the planner's ModelSpec functions (sliding layers: their windows only)."""
        end = start + new_tokens
        kv = self.spec.kv_bytes_read(end, self.plan.kv_bytes, self.tp, new_tokens, phase)
        return kv, self.spec.attention_flops_over(start, end, phase)

    def _roof(self, n_tokens: int, kv_bytes: float, attn_flops: float) -> tuple[float, float, dict]:
        """(weight bytes read, FLOPs, the planner's decode_step_time figures) of a step from its totals."""
        flops = (self.linear_flops_per_token * n_tokens + attn_flops) / self.tp
        w = self.weight_bytes_read(n_tokens) if n_tokens else 0.0
        return w, flops, decode_step_time(w, kv_bytes, 1, 1, self.bandwidth, flops, self.peak_flops)

    def bound(self, n_tokens: int, kv_bytes: float, attn_flops: float) -> float:
        """The bound alone (record()'s bound_s), for the estimates made before a step (core/step_time.py)."""
        return self._roof(n_tokens, kv_bytes, attn_flops)[2]["step_time_s"]

    def record(self, n_tokens: int, kv_bytes: float, attn_flops: float, prefill_tokens: int, decode_tokens: int,
               n_req: int, step_time_s: float, timestamp: float = 0.0, kv_cache_usage: float = 0.0) -> StepRoofline:
        """A step's record from its totals: KV bytes read and attention FLOPs (before the tp split)."""
        w, flops, roof = self._roof(n_tokens, kv_bytes, attn_flops)
        return StepRoofline(timestamp, step_time_s, roof["step_time_s"], roof["memory_time_s"], roof["compute_time_s"],
                            w, roof["kv_bytes_read"], flops, prefill_tokens, decode_tokens, n_req, kv_cache_usage)

    def describe(self) -> dict[str, Any]:
        hw = self.hardware
        return {"hardware": hw.name, "measured": hw.measured, "description": hw.description,
                "bandwidth_bytes_per_s": self.bandwidth, "peak_flops": self.peak_flops,
                "weight_dtype": self.plan.weight_dtype, "kv_dtype": self.plan.kv_dtype, "tp": self.tp}


# ---------------------------------------------------------------------------------------------
# hardware
# ---------------------------------------------------------------------------------------------

_GPU_NAME_TO_PRESET = (("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80gb"), ("l4", "l4"))
_measured: dict[tuple[str, str, bool], HardwareSpec] = {}  # (device, dtype, measured afresh) -> spec
_measure_lock = threading.Lock()

# start-up probes: the fastest of 3 runs of a 64 MiB copy and of a 1024^3 matmul on a CPU (~0.2-1 s
# in all on a 2-core VM), of the planner's default sizes on a GPU
_CPU_PROBE_BYTES = 64 << 20
_CPU_PROBE_MATMUL = 1024
_PROBES = 3


def resolve_hardware(device: str, dtype: str, name: Optional[str] = None) -> HardwareSpec:
    """The device's bandwidth and peak: the preset `name`, the preset of a known GPU, or measured
    (once per process and device/dtype) with the planner's probes."""
    if name and name != "measure":
        hw = get_hardware(name)
        if hw.hbm_bandwidth <= 0:  # the unmeasured `cpu` placeholder
            return resolve_hardware(device, dtype)
        return hw
    if name is None and device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name(torch.device(device)).lower()
        for key, preset in _GPU_NAME_TO_PRESET:
            if key in gpu:
                return GPU_PRESETS[preset]
    key = (device, dtype, name == "measure")
    with _measure_lock:
        if key not in _measured:
            _measured[key] = _measured_on_this_machine(device, dtype, fresh=name == "measure")
        return _measured[key]


def _machine_key(device: str, dtype: str) -> str:
    """What a measurement depends on: the device (CPU model, flags and cores; or the GPU's name), the
    threads torch uses, torch's version, the dtype."""
    import hashlib
    import os

    import torch

    parts = [device.split(":")[0], dtype, torch.__version__, str(torch.get_num_threads())]
    if device.startswith("cuda"):
        parts.append(torch.cuda.get_device_name(torch.device(device)))
    else:
        try:
            with open("/proc/cpuinfo") as f:
                info = f.read()
            parts += sorted({line for line in info.splitlines() if line.startswith(("model name", "flags"))})
        except OSError:
            import platform

            parts.append(platform.processor())
        parts.append(str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _measured_on_this_machine(device: str, dtype: str, fresh: bool = False) -> HardwareSpec:
    """The probes' result for this machine from the on-disk cache (config.cache_dir()/hardware-<key>.json),
    else measured now and saved there: a restart does not probe again (--roofline-hardware measure does,
    and refreshes the entry)."""
    import json
    from pathlib import Path

    from roofline.config import cache_dir, write_cache_file

    path = cache_dir() / f"hardware-{_machine_key(device, dtype)}.json"
    try:
        if fresh:
            raise OSError("measure afresh")
        d = json.loads(path.read_text())
        return HardwareSpec(name=d["name"], memory_bytes=0, hbm_bandwidth=float(d["hbm_bandwidth"]),
                            peak_flops={k: float(v) for k, v in d["peak_flops"].items()},
                            description=d["description"] + " (cached)", measured=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    hw = _measure(device, dtype)
    entry = json.dumps({"name": hw.name, "hbm_bandwidth": hw.hbm_bandwidth, "peak_flops": hw.peak_flops,
                        "description": hw.description})
    if not write_cache_file(path, lambda tmp: Path(tmp).write_text(entry)):
        logger.warning("could not cache the hardware probes in %s", path)
    return hw


def _measure(device: str, dtype: str) -> HardwareSpec:
    import torch

    from roofline.planner.probes import measure_bandwidth, measure_matmul_flops

    cpu = not device.startswith("cuda")
    # a roof is the best the device does: the fastest of a few probes (a busy machine slows some)
    bw = max(measure_bandwidth(device, nbytes=_CPU_PROBE_BYTES if cpu else None, repeats=1)
             for _ in range(_PROBES))
    fl = max(measure_matmul_flops(device, dtype, n=_CPU_PROBE_MATMUL if cpu else None, repeats=1)
             for _ in range(_PROBES))
    compute = {"fp16": "bf16"}.get(normalize_dtype(dtype), normalize_dtype(dtype))
    label = "cpu" if cpu else torch.cuda.get_device_name(torch.device(device))
    logger.info("live roofline: measured %s: %.1f GB/s copy bandwidth, %.1f GFLOP/s %s matmul", label, bw / 1e9,
                fl / 1e9, dtype)
    return HardwareSpec(name=label, memory_bytes=0, hbm_bandwidth=bw, peak_flops={compute: fl},
                        description=f"measured at start-up on {device}", measured=True)


def model_for_engine(hf_config: Any, device: str, dtype: str, kv_cache_dtype: str = "auto", tp: int = 1,
                     hardware: Optional[str] = None) -> StepRooflineModel:
    """The accounting for an engine: its model's shape, its resolved dtypes, its device."""
    spec = ModelSpec.from_hf_config(hf_config)
    wdt = normalize_dtype(dtype)
    kv = None if kv_cache_dtype in (None, "auto") else normalize_dtype(kv_cache_dtype)
    return StepRooflineModel(spec, resolve_hardware(device, dtype, hardware), wdt, kv or wdt, tp)


# ---------------------------------------------------------------------------------------------
# summaries
# ---------------------------------------------------------------------------------------------

def phase_medians(records: Iterable[StepRoofline]) -> dict[str, dict[str, float]]:
    """Per phase (and "all"): steps, median ratio, median step and bound (ms), share of memory-bound steps."""
    by: dict[str, list[StepRoofline]] = {"all": []}
    for r in records:
        by["all"].append(r)
        by.setdefault(r.phase, []).append(r)
    out: dict[str, dict[str, float]] = {}
    for phase, rs in by.items():
        if not rs:
            continue
        out[phase] = {"steps": len(rs), "median_ratio": statistics.median(r.ratio for r in rs),
                      "median_step_ms": 1e3 * statistics.median(r.step_time_s for r in rs),
                      "median_bound_ms": 1e3 * statistics.median(r.bound_s for r in rs),
                      "memory_bound_share": sum(r.roof == "memory" for r in rs) / len(rs)}
    return out


def format_phase_medians(summary: dict[str, dict[str, float]]) -> str:
    """One line: `live roofline (step time / bound, median): prefill 3.10x (12 steps, step 40.1 / bound
    12.9 ms median, compute-bound); decode ...` (`mean` where the summary has means, as from /metrics)."""
    parts = []
    for phase in ("prefill", "mixed", "decode"):
        s = summary.get(phase)
        if s:
            roof = "memory" if s["memory_bound_share"] >= 0.5 else "compute"
            stat = "median" if "median_step_ms" in s else "mean"
            parts.append(f"{phase} {s['median_ratio']:.2f}x ({int(s['steps'])} steps, step {s[stat + '_step_ms']:.1f}"
                         f" / bound {s[stat + '_bound_ms']:.2f} ms {stat}, {roof}-bound)")
    return "live roofline (step time / bound, median): " + ("; ".join(parts) if parts else "no steps recorded")


class RatioWindow:
    """Median step-vs-bound ratio over the last `size` steps, overall and per phase (the gauge)."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self._by: dict[str, deque] = {p: deque(maxlen=size) for p in ("all",) + PHASES}

    def add(self, record: StepRoofline) -> None:
        r = record.ratio
        if math.isfinite(r):
            self._by["all"].append(r)
            self._by[record.phase].append(r)

    def medians(self) -> dict[str, float]:
        return {p: statistics.median(xs) for p, xs in self._by.items() if xs}
