"""The engines behind the router: each one's health and load, and the loop that checks them.

A backend is healthy while its /health answers 200.  One that fails (refused connection, timeout,
a 5xx health answer, or a connection error while serving a request) is taken out of rotation; the
health loop keeps probing it and brings it back once /health answers 200 again.  The same probe
reads the engine's /metrics for its load (requests running + waiting).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

from roofline.metrics.prometheus import metric_value, parse_metrics

logger = logging.getLogger(__name__)


@dataclass
class Backend:
    url: str
    role: str  # "prefill" | "decode" | "replica"
    healthy: bool = True
    in_flight: int = 0  # requests the router has open there now
    reported_load: float = 0.0  # running + waiting, from the engine's last /metrics
    requests: int = 0
    errors: int = 0
    last_error: Optional[str] = None
    last_check: float = field(default=0.0)

    @property
    def load(self) -> float:
        return max(self.in_flight, self.reported_load)

    def mark_down(self, why: str) -> None:
        if self.healthy:
            logger.warning("backend %s (%s) is down: %s", self.url, self.role, why)
        self.healthy = False
        self.last_error = why


class BackendPool:
    def __init__(self, backends: list[Backend], health_interval: float = 2.0, health_timeout: float = 2.0,
                 headers: Optional[dict[str, str]] = None) -> None:
        self.backends = backends
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.headers = headers or {}
        self._task: Optional[asyncio.Task] = None

    def of_role(self, role: str, healthy_only: bool = True) -> list[Backend]:
        return [b for b in self.backends if b.role == role and (b.healthy or not healthy_only)]

    @property
    def roles(self) -> list[str]:
        return sorted({b.role for b in self.backends})

    async def check(self, client: httpx.AsyncClient, b: Backend) -> None:
        try:
            r = await client.get(b.url + "/health", timeout=self.health_timeout)
            ok = r.status_code == 200
            if ok:
                m = await client.get(b.url + "/metrics", timeout=self.health_timeout, headers=self.headers)
                if m.status_code == 200:
                    values = parse_metrics(m.text)
                    b.reported_load = (metric_value(values, "roofline:num_requests_running")
                                       + metric_value(values, "roofline:num_requests_waiting"))
        except httpx.HTTPError as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        else:
            why = f"/health answered {r.status_code}"
        b.last_check = time.monotonic()
        if ok and not b.healthy:
            logger.info("backend %s (%s) is back", b.url, b.role)
            b.healthy, b.last_error = True, None
        elif not ok:
            b.mark_down(why)

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, b) for b in self.backends))

    async def _loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_all(client)
            except Exception:  # never let the health loop die
                logger.exception("health check failed")

    def start(self, client: httpx.AsyncClient) -> None:
        self._task = asyncio.ensure_future(self._loop(client))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
