"""Per-iteration serving statistics and the loggers that consume them.

The engine loop (AsyncLLM's thread) builds one `IterationStats` per iteration and hands it to every
`StatLogger`. Loggers only read it: Prometheus export lives in `prometheus.py`, a periodic log line
in `LoggingStatLogger` below. Engine-wide numbers come from the core's `EngineStats` snapshot, read by
attribute so this module does not import the engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

logger = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    """One request that left the engine during the iteration (finished, aborted or failed)."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float  # seconds from arrival to the final output
    queue_time: Optional[float]  # seconds from arrival to first scheduling (None if never scheduled)
    ttft: Optional[float]
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    timestamp: float  # time.monotonic() at the end of the iteration
    engine: Any = None  # the core's EngineStats snapshot (or None if unavailable)
    ttfts: list[float] = field(default_factory=list)  # time to first token of requests that got it now
    itls: list[float] = field(default_factory=list)  # gaps between consecutive tokens, seconds
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_new_prompt_tokens: int = 0  # prompt tokens of requests that started this iteration
    num_new_generation_tokens: int = 0  # tokens generated this iteration


class StatLogger(Protocol):
    def record(self, stats: IterationStats) -> None: ...


def stat(engine_stats: Any, name: str, default: float = 0) -> float:
    """Read one field of an EngineStats-like object, tolerating missing fields."""
    if engine_stats is None:
        return default
    value = getattr(engine_stats, name, default)
    return default if value is None else value


class LoggingStatLogger:
    """Logs throughput and queue state every `interval` seconds while the engine is busy."""

    def __init__(self, interval: float = 10.0, log: logging.Logger = logger) -> None:
        self.interval = interval
        self.log = log
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last_queries = 0.0
        self._last_hits = 0.0
        self._cum: Optional[tuple[int, int]] = None

    def record(self, stats: IterationStats) -> None:
        e = stats.engine
        if e is not None and hasattr(e, "prompt_tokens") and hasattr(e, "generation_tokens"):
            # the core's cumulative counters: prompt tokens count once prefilled
            if self._cum is None:
                self._cum = (e.prompt_tokens, e.generation_tokens)
            self._prompt_tokens += e.prompt_tokens - self._cum[0]
            self._generation_tokens += e.generation_tokens - self._cum[1]
            self._cum = (e.prompt_tokens, e.generation_tokens)
        else:
            self._prompt_tokens += stats.num_new_prompt_tokens
            self._generation_tokens += stats.num_new_generation_tokens
        elapsed = stats.timestamp - self._last_time
        if elapsed < self.interval:
            return
        queries, hits = stat(e, "prefix_cache_queries"), stat(e, "prefix_cache_hits")
        dq, dh = queries - self._last_queries, hits - self._last_hits
        hit_rate = f"{100.0 * dh / dq:.1f}%" if dq > 0 else "n/a"
        self.log.info(
            "prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
            "KV cache usage %.1f%%, prefix cache hit rate %s",
            self._prompt_tokens / elapsed,
            self._generation_tokens / elapsed,
            stat(e, "num_running"),
            stat(e, "num_waiting"),
            100.0 * stat(e, "kv_cache_usage"),
            hit_rate,
        )
        self._last_time = stats.timestamp
        self._prompt_tokens = self._generation_tokens = 0
        self._last_queries, self._last_hits = queries, hits
