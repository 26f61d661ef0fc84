"""The router's FastAPI app: an OpenAI-compatible proxy in front of engines.

PD mode (--prefill URL ... --decode URL ...), per request:
  1. the prompt goes to a prefill engine with max_tokens=1, stream=false and
     kv_transfer_params={"do_remote_decode": true}; its answer carries the kv_transfer_params a decode
     engine needs (where the prompt's KV blocks are);
  2. the original request, plus those kv_transfer_params, goes to a decode engine, which loads the
     KV, computes the prompt's last token and generates the whole answer; it is passed through to the
     client as it comes (SSE bytes untouched when streaming).  When no decode engine takes it (none
     reachable, one refused it, or the client left first), the router tells the prefill engine to free
     the held blocks at once (kv_transfer.p2p.release_held_kv) instead of at its send timeout.
Replica mode (--replica URL ...): each request goes whole to one data-parallel replica.

Which engine of a kind serves a request is the policy's choice (policies.py).  An engine that refuses
the connection is marked down and the next one is tried (nothing was generated yet, so that is safe);
errors after that end in an OpenAI-shaped error to the client (502), or an SSE error event and
[DONE] mid-stream.  A client that disconnects closes the router's upstream connections, and the
engines abort its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from roofline.client_disconnect import run_cancellable
from roofline.kv_transfer.p2p import release_held_kv
from roofline.router.backends import Backend, BackendPool
from roofline.router.policies import make_policy

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization",)


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    policy: str = "round_robin"
    block_tokens: int = 16  # prefix_aware: tokens per prompt chunk
    health_interval: float = 2.0
    request_timeout: float = 600.0
    backend_api_key: Optional[str] = None  # sent to engines when the client sends no Authorization

    def __post_init__(self) -> None:
        pd = bool(self.prefill or self.decode)
        if pd and self.replicas:
            raise ValueError("give either --prefill and --decode engines, or --replica engines, not both")
        if pd and not (self.prefill and self.decode):
            raise ValueError("PD mode needs at least one --prefill and one --decode engine")
        if not pd and not self.replicas:
            raise ValueError("no engines: give --prefill URL ... --decode URL ..., or --replica URL ...")
        for url in self.prefill + self.decode + self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} must start with http:// or https://")

    @property
    def pd(self) -> bool:
        return bool(self.prefill)


class RouterError(Exception):
    def __init__(self, status: int, message: str, type: str = "router_error") -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": None, "code": None}},
                            status_code=self.status)


def upstream_failure(role: str, b: Backend, e: BaseException, when: str = "failed") -> str:
    """What a client is told when an engine fails: the role and an error id; the engine's URL and the
    exception go to the log under that id."""
    ref = f"err-{uuid.uuid4().hex[:16]}"
    logger.error("the %s engine %s %s (%s): %s: %s", role, b.url, when, ref, type(e).__name__, e)
    return f"the {role} engine {when} (error {ref}); the router log has the details"


def sse_error(message: str) -> bytes:
    err = {"error": {"message": message, "type": "router_error", "param": None, "code": None}}
    return ("data: " + json.dumps(err) + "\n\ndata: [DONE]\n\n").encode()


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        backends = ([Backend(u.rstrip("/"), "prefill") for u in config.prefill]
                    + [Backend(u.rstrip("/"), "decode") for u in config.decode]
                    + [Backend(u.rstrip("/"), "replica") for u in config.replicas])
        headers = {"Authorization": f"Bearer {config.backend_api_key}"} if config.backend_api_key else {}
        self.pool = BackendPool(backends, config.health_interval, headers=headers)
        self.policies = {role: make_policy(config.policy, config.block_tokens) for role in self.pool.roles}
        self.client: Optional[httpx.AsyncClient] = None
        self.requests = 0
        self.request_errors = 0
        self.client_disconnects = 0

    def headers(self, request: Request) -> dict[str, str]:
        out = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        if "authorization" not in out and self.config.backend_api_key:
            out["authorization"] = f"Bearer {self.config.backend_api_key}"
        return out

    # ---- one upstream call --------------------------------------------------------------------------
    async def open(self, role: str, path: str, body: dict, headers: dict) -> tuple[Backend, httpx.Response]:
        """Send body to an engine of `role` chosen by the policy; an engine that cannot be reached is
        marked down and the next one tried.  The caller closes the response and calls done(backend)."""
        assert self.client is not None
        tried: set[str] = set()
        while True:
            candidates = [b for b in self.pool.of_role(role) if b.url not in tried]
            if not candidates:
                raise RouterError(503, f"no healthy {role} engine is available", "service_unavailable")
            b = self.policies[role].choose(candidates, body)
            tried.add(b.url)
            b.in_flight += 1
            b.requests += 1
            try:
                req = self.client.build_request("POST", b.url + path, json=body, headers=headers)
                return b, await self.client.send(req, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self.done(b, error=True)
                b.mark_down(f"{type(e).__name__}: {e}")
            except httpx.HTTPError as e:
                self.done(b, error=True)
                raise RouterError(502, upstream_failure(role, b, e)) from e

    @staticmethod
    def done(b: Backend, error: bool = False) -> None:
        b.in_flight -= 1
        if error:
            b.errors += 1

    async def read(self, role: str, path: str, body: dict, headers: dict) -> tuple[int, bytes]:
        """A whole (non-streamed) answer from an engine of `role`."""
        b, resp = await self.open(role, path, body, headers)
        failed = True
        try:
            content = await resp.aread()
            failed = resp.status_code >= 500
            return resp.status_code, content
        except httpx.HTTPError as e:
            b.mark_down(f"{type(e).__name__}: {e}")
            raise RouterError(502, upstream_failure(role, b, e, "failed mid-answer")) from e
        finally:
            await resp.aclose()
            self.done(b, error=failed)

    async def stream(self, role: str, path: str, body: dict, headers: dict) -> Response:
        """The engine's answer passed through as it comes."""
        b, resp = await self.open(role, path, body, headers)
        if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                self.done(b, error=resp.status_code >= 500)
            return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            failed = False
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:  # the engine died mid-answer
                failed = True
                b.mark_down(f"{type(e).__name__}: {e}")
                self.request_errors += 1
                yield sse_error(upstream_failure(role, b, e, "failed mid-answer"))
            finally:  # done, failed, or the client went away (the generator is closed): drop the upstream
                await resp.aclose()
                self.done(b, error=failed)

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- the two modes ---------------------------------------------------------------------------------
    async def prefill(self, path: str, body: dict, headers: dict) -> Any:
        """Step 1 of PD: returns the decode body (the request plus kv_transfer_params), or an error Response."""
        pre = dict(body, stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        pre.pop("stream_options", None)
        if "messages" in body:
            pre["max_completion_tokens"] = 1
        status, content = await self.read("prefill", path, pre, headers)
        if status != 200:
            return Response(content, status_code=status, media_type="application/json")
        try:
            params = json.loads(content).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            raise RouterError(502, "the prefill engine answered without kv_transfer_params "
                                   "(is it started with --kv-transfer-config and kv_role kv_producer?)")
        return dict(body, kv_transfer_params=params)

    async def handle(self, request: Request, path: str) -> Response:
        self.requests += 1
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return RouterError(400, "the request body must be a JSON object", "invalid_request_error").response()
        if self.config.pd and body.get("n", 1) != 1:
            return RouterError(400, "n must be 1 with prefill/decode disaggregation", "invalid_request_error").response()
        headers = self.headers(request)
        role = "decode" if self.config.pd else "replica"
        held: Optional[dict] = None  # PD: the prefill's kv_transfer_params until a decode engine took them
        try:
            if self.config.pd:
                decode_body = await run_cancellable(request, self.prefill(path, body, headers))
                if isinstance(decode_body, Response):  # the prefill's error, or 499: the client left
                    self.client_disconnects += decode_body.status_code == 499
                    return decode_body
                body, held = decode_body, decode_body["kv_transfer_params"]
            if body.get("stream"):
                response = await self.stream(role, path, body, headers)
                if response.status_code == 200:
                    held = None
                return response
            result = await run_cancellable(request, self.read(role, path, body, headers))
            if isinstance(result, Response):
                self.client_disconnects += 1
                return result
            status, content = result
            if status == 200:
                held = None
            return Response(content, status_code=status, media_type="application/json")
        except RouterError as e:
            self.request_errors += 1
            return e.response()
        finally:
            if held is not None:  # no decode engine took the prefill's KV: its engine frees it now, not at timeout
                await asyncio.to_thread(release_held_kv, held)

    # ---- operational ---------------------------------------------------------------------------------
    def healthy(self) -> bool:
        return all(self.pool.of_role(role) for role in self.pool.roles)

    def metrics_text(self) -> str:
        lines = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP roofline_router:{name} {doc}")
            lines.append(f"# TYPE roofline_router:{name} {kind}")
            lines.extend(f"roofline_router:{name}{labels} {value}" for labels, value in samples)

        per = [(f'{{backend="{b.url}",role="{b.role}"}}', b) for b in self.pool.backends]
        metric("backend_healthy", "gauge", "1 while the engine answers its health check.",
               [(lab, float(b.healthy)) for lab, b in per])
        metric("backend_in_flight", "gauge", "Requests the router has open at the engine.",
               [(lab, float(b.in_flight)) for lab, b in per])
        metric("backend_reported_load", "gauge", "Running + waiting requests the engine last reported.",
               [(lab, float(b.reported_load)) for lab, b in per])
        metric("backend_requests_total", "counter", "Requests sent to the engine.",
               [(lab, float(b.requests)) for lab, b in per])
        metric("backend_errors_total", "counter", "Requests the engine failed (unreachable, 5xx, broken stream).",
               [(lab, float(b.errors)) for lab, b in per])
        metric("requests_total", "counter", "Requests the router received.", [("", float(self.requests))])
        metric("request_errors_total", "counter", "Requests that ended in a router error.",
               [("", float(self.request_errors))])
        metric("client_disconnects_total", "counter", "Clients gone before their answer was ready.",
               [("", float(self.client_disconnects))])
        return "\n".join(lines) + "\n"


def build_router_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout, connect=5.0), limits=limits)
        await router.pool.check_all(router.client)
        router.pool.start(router.client)
        try:
            yield
        finally:
            await router.pool.stop()
            await router.client.aclose()

    app = FastAPI(title="roofline router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for b in router.pool.of_role("decode" if config.pd else "replica"):
            try:
                r = await router.client.get(b.url + "/v1/models", headers=router.headers(request))
            except httpx.HTTPError as e:
                b.mark_down(f"{type(e).__name__}: {e}")
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return RouterError(503, "no healthy engine is available", "service_unavailable").response()

    @app.get("/health")
    async def health() -> Response:
        # counts per role only: this route is open, and engine URLs and errors are for the log and /metrics
        engines = {role: {"healthy": sum(b.healthy for b in router.pool.backends if b.role == role),
                          "total": sum(b.role == role for b in router.pool.backends)} for role in router.pool.roles}
        return JSONResponse({"status": "ok" if router.healthy() else "unhealthy", "engines": engines},
                            status_code=200 if router.healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics_text(), media_type="text/plain; version=0.0.4")

    return app
