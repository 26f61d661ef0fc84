"""Who may call which route: the API key and the shutdown gate, as one ASGI middleware.

With --api-key every route needs `Authorization: Bearer <key>` except /health (load balancers probe
it) and, when --no-metrics-require-key, /metrics; that covers /docs, /openapi.json, /tokenize and
whatever a module adds later, without each route remembering to ask.  While the server drains for a
shutdown, every new request but /health and /metrics gets 503 (and /health says "draining").
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Callable, Optional

OPEN_PATHS = ("/health",)


def _error_body(status: int, message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class AccessMiddleware:
    def __init__(self, app: Any, api_key: Optional[str], metrics_require_key: bool = True,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS + ("/metrics",)
        self.draining = draining

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.api_key is not None and path not in self.open_paths and not self._authorized(scope):
            return await self._reply(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                     "invalid_request_error", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
        if self.draining() and path not in ("/health", "/metrics"):
            return await self._reply(send, 503, "the server is shutting down", "service_unavailable",
                                     "shutting_down", [(b"connection", b"close")])
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    @staticmethod
    async def _reply(send: Any, status: int, message: str, type_: str, code: str, extra_headers: list) -> None:
        body = _error_body(status, message, type_, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers + extra_headers})
        await send({"type": "http.response.body", "body": body})
