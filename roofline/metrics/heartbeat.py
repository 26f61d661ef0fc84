"""The engine's recent heartbeat for the live dashboard: the last steps and the latest engine snapshot.

`Heartbeat` is a StatLogger: the engine thread hands it every iteration's stats, and it keeps the
last `max_steps` live-roofline step records (metrics/step_roofline.py) with the latest EngineStats
figures. `snapshot()` (called from the server's event loop, hence the lock) returns plain JSON-ready
data: what `/stats` serves and `/dashboard` draws. It reads only what travels in the stats
(EngineStats / IterationStats), never the engine core.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Optional

from roofline.metrics.stats import IterationStats, stat
from roofline.metrics.step_roofline import RatioWindow, StepRoofline

ENGINE_FIELDS = ("num_running", "num_waiting", "kv_cache_usage", "num_total_blocks", "num_free_blocks",
                 "num_cached_blocks", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                 "prompt_tokens", "generation_tokens")


def step_json(r: StepRoofline) -> dict[str, Any]:
    return {"t": r.timestamp, "step_ms": 1e3 * r.step_time_s, "bound_ms": 1e3 * r.bound_s,
            "memory_ms": 1e3 * r.memory_s, "compute_ms": 1e3 * r.compute_s,
            "ratio": r.ratio if r.bound_s > 0 else None, "roof": r.roof, "phase": r.phase,
            "prefill_tokens": r.prefill_tokens, "decode_tokens": r.decode_tokens, "requests": r.num_requests,
            "weight_bytes": r.weight_bytes, "kv_bytes": r.kv_bytes, "flops": r.flops,
            "kv_cache_usage": r.kv_cache_usage,
            # the scheduler's plan (null where it made none): predicted time, token budget, its target, draft length
            "predicted_ms": 1e3 * r.predicted_s if r.predicted_s > 0 else None,
            "token_budget": r.token_budget or None, "target_ms": 1e3 * r.target_s if r.target_s > 0 else None,
            "draft_length": r.draft_length if r.draft_length >= 0 else None}


class Heartbeat:
    def __init__(self, max_steps: int = 300, window: int = 64) -> None:
        self._lock = threading.Lock()
        self._steps: deque[StepRoofline] = deque(maxlen=max_steps)
        self._window = RatioWindow(window)
        self._engine: dict[str, float] = {}
        self._device: dict[str, float] = {}
        self._totals = {"steps": 0, "step_seconds": 0.0, "bound_seconds": 0.0, "bytes_read": 0.0, "flops": 0.0}
        self._updated: Optional[float] = None

    def record(self, stats: IterationStats) -> None:
        e = stats.engine
        if e is None:
            return
        records = getattr(e, "step_roofline", None) or []
        engine = {f: stat(e, f) for f in ENGINE_FIELDS}
        with self._lock:
            self._engine = engine
            self._updated = time.time()
            for r in records:
                self._steps.append(r)
                self._window.add(r)
                t = self._totals
                t["steps"] += 1
                t["step_seconds"] += r.step_time_s
                t["bound_seconds"] += r.bound_s
                t["bytes_read"] += r.bytes_read
                t["flops"] += r.flops
            if records:
                last = records[-1]  # the device figures the bound used, recovered from a record
                if last.memory_s > 0:
                    self._device["bandwidth_bytes_per_s"] = last.bytes_read / last.memory_s
                if last.compute_s > 0:
                    self._device["peak_flops"] = last.flops / last.compute_s

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            steps = [step_json(r) for r in self._steps]
            return {"updated": self._updated, "now": time.monotonic(), "engine": dict(self._engine), "device": dict(self._device),
                    "roofline": {"window_median_ratio": self._window.medians(), "window_steps": self._window.size,
                                 "totals": dict(self._totals)},
                    "steps": steps}
