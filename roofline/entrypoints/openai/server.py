"""The OpenAI-compatible HTTP server: FastAPI app factory, uvicorn runner, graceful shutdown.

`build_app(engine, config)` wires the routes to an AsyncLLM; `run_server(engine_args, config)` loads
the engine, serves until SIGINT/SIGTERM and returns 0. `ServerThread` runs an app on a loopback port
in a background thread (tests, benchmarks).

Shutdown (SIGINT/SIGTERM, or ServerThread.stop): the server drains first.  New requests get 503
(access.py) while the listening socket stays open, requests in flight get up to `shutdown_timeout`
seconds to finish, and any still running then are aborted: a stream ends with an error event and
`[DONE]`, a plain request gets a 503.  Only then do the connections close.

LoRA adapters (--enable-lora): a request picks an adapter by its `"model"` (serving_models.py: the names,
/v1/models with each adapter's parent, 404 for a name not served), --lora-modules registers adapters at
start-up, and --allow-runtime-lora-updating adds POST /v1/load_lora_adapter and /v1/unload_lora_adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from roofline.client_disconnect import run_cancellable
from roofline.engine.async_llm import AsyncLLM, RequestAbortedError
from roofline.entrypoints.openai.access import AccessMiddleware
from roofline.entrypoints.openai.dashboard import add_dashboard_routes
from roofline.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from roofline.entrypoints.openai.http_protocol import head_deadline_protocol
from roofline.entrypoints.openai.openapi import install_openapi
from roofline.engine.chat_template import load_chat_template, resolve_content_format
from roofline.entrypoints.openai.serving_chat import ChatOptions, OpenAIServingChat, apply_chat_template
from roofline.entrypoints.openai.serving_completion import OpenAIServingCompletion
from roofline.entrypoints.openai.serving_models import ServingModels
from roofline.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponsesRequest
from roofline.entrypoints.openai.serving_engine import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_COMPLETIONS_PER_REQUEST,
    APIError,
    SSEStream,
    bad_request,
    parse_model,
    read_json_body,
)
from roofline.entrypoints.openai.tokenization import ServerTokenizer
from roofline.metrics.prometheus import PrometheusStatLogger
from roofline.metrics.stats import LoggingStatLogger

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
LARGE_BODY_BYTES = 1 << 20  # request bodies past this are validated off the event loop
DEFAULT_MODEL_ALIASES = ("HuggingFaceTB/SmolLM2-135M-Instruct",)


def roofline_version() -> str:
    try:
        from importlib.metadata import version

        return version("roofline")
    except Exception:
        return "0.1.0"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: Optional[str] = None  # default: derived from the model
    api_key: Optional[str] = None
    metrics_require_key: bool = True  # with api_key, /metrics needs it too (/health never does)
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_completions_per_request: int = DEFAULT_MAX_COMPLETIONS_PER_REQUEST  # prompts x n of one request
    request_body_timeout: float = DEFAULT_BODY_TIMEOUT_S  # seconds a client has to send its whole body
    request_head_timeout: float = DEFAULT_HEAD_TIMEOUT_S  # seconds a connection has to send a request head
    trust_request_chat_template: bool = False  # render a request's own chat_template (sandboxed)
    template_timeout_s: float = 2.0  # a request chat template's render time limit
    max_template_renders_per_client: int = 2  # request chat templates in flight per client address (429 beyond)
    chat_template: Optional[str] = None  # --chat-template: a path or the template (default: the model's)
    chat_template_content_format: str = "auto"  # auto | string | openai
    enable_auto_tool_choice: bool = False
    tool_call_parser: Optional[str] = None  # hermes, llama3_json, mistral, pythonic, deepseek_v3, qwen3_coder
    reasoning_parser: Optional[str] = None  # deepseek_r1, qwen3, deepseek_v3
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGINT/SIGTERM
    retry_after: int = 1  # seconds, in 503 queue-full answers
    log_stats_interval: float = 10.0  # 0 disables the periodic log line
    uvicorn_log_level: str = "info"
    access_log: bool = True
    lora_modules: tuple = ()  # serving_models.LoRAModulePath of each --lora-modules adapter (needs --enable-lora)
    allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter


def model_names(model_config: Any, override: Optional[str] = None) -> list[str]:
    """Names a request's `model` may use: the served name first (what /v1/models lists), then
    aliases (the model argument as given, its base name; the HF id of the default model)."""
    if override:
        return [override]
    names: list[str] = []
    served = getattr(model_config, "served_model_name", None)
    model = getattr(model_config, "model", None)
    if served:
        names.append(served)
    if not model:
        names += [DEFAULT_MODEL_NAME, *DEFAULT_MODEL_ALIASES]
    else:
        base = os.path.basename(os.path.normpath(str(model)))
        if base.endswith(".gguf"):
            base = base[: -len(".gguf")]
        names += [base, str(model)]
    out: list[str] = []
    for n in names:
        if n and n not in out:
            out.append(n)
    return out


def _vocab_size(engine: AsyncLLM, tokenizer: Any) -> Optional[int]:
    hf = getattr(engine.model_config, "hf_config", None)
    size = getattr(hf, "vocab_size", None)
    if size:
        return int(size)
    try:
        return len(tokenizer)
    except Exception:
        return None


def build_app(engine: AsyncLLM, config: Optional[ServerConfig] = None, *, shutdown_engine: bool = True) -> FastAPI:
    config = config or ServerConfig()
    names = model_names(engine.model_config, config.served_model_name)
    model_name = names[0]
    max_model_len = int(engine.model_config.max_model_len)
    chat_template = load_chat_template(config.chat_template)
    chat_options = ChatOptions(
        enable_auto_tool_choice=config.enable_auto_tool_choice, tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
        chat_template_content_format=resolve_content_format(
            config.chat_template_content_format,
            chat_template or getattr(engine.tokenizer, "chat_template", None)))
    tokenizer = (ServerTokenizer(engine.tokenizer, max_model_len,
                                 trust_request_chat_template=config.trust_request_chat_template,
                                 template_timeout_s=config.template_timeout_s,
                                 max_template_renders_per_client=config.max_template_renders_per_client,
                                 chat_template=chat_template)
                 if engine.tokenizer is not None else None)
    vocab_size = _vocab_size(engine, tokenizer.loop if tokenizer is not None else None)
    models = serving_models(engine, names, max_model_len, vocab_size, config)
    metrics = PrometheusStatLogger(model_name, lora=getattr(engine, "lora_config", None) is not None)
    engine.stat_loggers.append(metrics)
    completions = OpenAIServingCompletion(engine, tokenizer, models, max_model_len, config.max_completions_per_request)
    chat = OpenAIServingChat(engine, tokenizer, models, max_model_len, config.max_completions_per_request,
                             chat_options)
    responses = OpenAIServingResponses(chat)
    limit = config.max_request_body_bytes

    async def parse(request: Request, cls: Any) -> Any:
        """The request body as a `cls`; large bodies are validated off the event loop."""
        obj = await read_json_body(request, limit, config.request_body_timeout)
        if int(request.headers.get("content-length") or 0) > LARGE_BODY_BYTES:
            return await asyncio.to_thread(parse_model, cls, obj)
        return parse_model(cls, obj)

    async def large_json(payload: dict) -> Response:
        """A JSON answer serialized off the event loop, its lists a slice at a time (json_bytes)."""
        return Response(await asyncio.to_thread(json_bytes, payload), media_type="application/json")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if metrics in engine.stat_loggers:
            engine.stat_loggers.remove(metrics)
        if tokenizer is not None:
            tokenizer.close()
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="roofline", version=roofline_version(), lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.config = config
    app.state.model_names = names
    app.state.models = models
    app.state.draining = False
    app.add_middleware(AccessMiddleware, api_key=config.api_key, metrics_require_key=config.metrics_require_key,
                       draining=lambda: app.state.draining)
    add_dashboard_routes(app, engine)  # /stats and /dashboard (the live roofline heartbeat)

    # ------------------------------------------------------------------ errors
    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.to_response().model_dump(mode="json"), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(e.status_code, "invalid_request_error")
        return error_response(APIError(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        param = ".".join(str(p) for p in errs[0]["loc"][1:]) if errs else None
        return error_response(bad_request(f"invalid request: {errs[0]['msg'] if errs else e}", param=param))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error for %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error"))

    # ------------------------------------------------------------------ helpers
    check_model = models.check  # 404 for a name that is neither the base model nor an adapter served

    def respond(result: Any) -> Response:
        if isinstance(result, Response):
            return result
        if isinstance(result, SSEStream):
            return _SSEResponse(result)
        return JSONResponse(result if isinstance(result, dict) else result.model_dump(mode="json"))

    # ------------------------------------------------------------------ /v1
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def list_models() -> Any:
        return ModelList(data=models.cards()).model_dump()

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> Any:
        return models.card(model_id).model_dump()

    if config.allow_runtime_lora_updating:  # off by default; under --api-key like every route but /health
        @v1.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            req = await parse(request, LoadLoRAAdapterRequest)
            await asyncio.to_thread(models.load, req.lora_name, req.lora_path)
            return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.", media_type="text/plain")

        @v1.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            req = await parse(request, UnloadLoRAAdapterRequest)
            models.unload(req.lora_name)
            return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.",
                            media_type="text/plain")

    async def generate(request: Request, cls: Any, create: Any, per_client: bool = False) -> Response:
        """A generation route: parse and check the body, then a stream answers at once and a whole answer is
        cancelled if the client leaves.  per_client: create also takes the sender's address."""
        req = await parse(request, cls)
        check_model(req.model)
        args = (req, request.client.host if request.client else "") if per_client else (req,)
        if req.stream:
            return respond(await create(*args))
        return respond(await run_cancellable(request, create(*args)))

    @v1.post("/completions")
    async def create_completion(request: Request) -> Response:
        return await generate(request, CompletionRequest, completions.create)

    @v1.post("/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, chat.create, per_client=True)

    @v1.post("/responses")
    async def create_response(request: Request) -> Response:
        return await generate(request, ResponsesRequest, responses.create, per_client=True)

    app.include_router(v1)

    # ------------------------------------------------------------------ operational routes
    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        # the cause (host names, PIDs, ports, library output) is in the log, not on an open route
        return JSONResponse({"status": "unhealthy", "error": "the engine has stopped"}, status_code=503)

    @app.get("/version")
    async def version() -> Any:
        return {"version": roofline_version()}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        req = await parse(request, TokenizeRequest)
        check_model(req.model)
        if tokenizer is None:
            raise bad_request("this model has no tokenizer")
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            _, ids = await apply_chat_template(tokenizer, req.messages, add_generation_prompt=req.add_generation_prompt,
                                               content_format=chat_options.chat_template_content_format)
        else:
            ids = await tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens, bounded=False)
        strs = await tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        answer = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}  # TokenizeResponse's shape
        if strs is not None:
            answer["token_strs"] = strs
        return await large_json(answer)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Any:
        req = await parse(request, DetokenizeRequest)
        check_model(req.model)
        if tokenizer is None:
            raise bad_request("this model has no tokenizer")
        if vocab_size is not None:
            bad = [t for t in req.tokens if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"token ids out of range [0, {vocab_size}): {bad[:5]}", param="tokens")
        try:
            text = await tokenizer.decode(req.tokens)
        except Exception as e:
            raise bad_request(f"cannot decode tokens: {e}", param="tokens")
        return await large_json({"prompt": text})  # DetokenizeResponse's shape

    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                          "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest,
                          "/detokenize": DetokenizeRequest,
                          **({"/v1/load_lora_adapter": LoadLoRAAdapterRequest,
                              "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest}
                             if config.allow_runtime_lora_updating else {})})
    return app


def serving_models(engine: AsyncLLM, names: list[str], max_model_len: int, vocab_size: Optional[int],
                   config: ServerConfig) -> ServingModels:
    """The base model's names and the LoRA adapters served: --lora-modules checked against the model now
    (a ValueError naming a bad one)."""
    lora = engine.lora_config
    validator = None
    if lora is not None:
        from roofline.lora.mapping import AdapterValidator

        validator = AdapterValidator(engine.model_config.hf_config, lora.max_lora_rank)
    elif config.allow_runtime_lora_updating:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    return ServingModels(names, str(engine.model_config.model or names[0]), max_model_len, vocab_size, validator,
                         tuple(config.lora_modules))


JSON_SLICE = 8192  # list items serialized per call: the GIL changes hands between slices


def json_bytes(payload: dict) -> bytes:
    """json.dumps(payload) for a flat dict whose values may be long lists, written a slice of each list at
    a time: one json.dumps of a 3.5M-token list holds the GIL ~0.3 s, and the event loop with it."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, list):
            items = [json.dumps(value[i:i + JSON_SLICE], ensure_ascii=False)[1:-1]
                     for i in range(0, len(value), JSON_SLICE)]
            parts.append(f"{json.dumps(key)}:[{','.join(x for x in items if x)}]")
        else:
            parts.append(f"{json.dumps(key)}:{json.dumps(value, ensure_ascii=False)}")
    return ("{" + ",".join(parts) + "}").encode()


class _SSEResponse(StreamingResponse):
    """Server-sent events; however the response ends (done, client gone, cancelled), the engine
    requests behind it are aborted if still running."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.stream.aclose()


# --------------------------------------------------------------------------- running it
class _Server(uvicorn.Server):
    """uvicorn's Server that drains before it closes (module docstring) and does not re-raise the
    caught signal after a graceful shutdown, so that SIGINT/SIGTERM end the process with status 0."""

    def __init__(self, config: uvicorn.Config, app: Optional[FastAPI] = None, drain_timeout: float = 30.0) -> None:
        super().__init__(config)
        self.roofline_app = app
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets=None) -> None:
        app = self.roofline_app
        if app is not None and not self.force_exit:
            await drain(app, self.drain_timeout)
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.info("received %s: no new connections; finishing in-flight requests",
                        signal.Signals(sig).name)
        self.handle_exit(sig, frame)


async def drain(app: FastAPI, timeout: float) -> None:
    """New requests get 503; wait up to `timeout` s for the engine's requests to finish, then abort
    the rest (their streams end with an error event and [DONE]) and give them a moment to flush."""
    app.state.draining = True
    engine: Optional[AsyncLLM] = getattr(app.state, "engine", None)
    if engine is None:  # an app without an engine (the router): uvicorn's own graceful shutdown
        return
    deadline = time.monotonic() + timeout
    while engine.num_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = engine.num_in_flight()
    if left:
        logger.warning("shutdown: aborting %d request(s) still running after %.0f s", left, timeout)
        engine.abort_all_nowait(RequestAbortedError("the server is shutting down"))
        flush_by = time.monotonic() + 5.0
        while engine.num_in_flight() and time.monotonic() < flush_by:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the handlers write their last events


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a busy port fails fast).

    Its protocol is given as IPPROTO_TCP, not left 0: asyncio turns Nagle's algorithm off
    (TCP_NODELAY) only on accepted sockets whose protocol says TCP.  With Nagle on, a response written
    in two pieces (uvicorn writes the head, then the body; a stream writes one event at a time) waits
    for the client's delayed ACK of the first piece: 40 ms added to every response on a kept-alive
    connection and to stream events, measured at 44 ms against 0.3 ms for GET /health."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets on Linux
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    # the drain (above) bounds the wait for requests; uvicorn's own timeout is a backstop past it
    return uvicorn.Config(app, log_level=config.uvicorn_log_level, access_log=config.access_log,
                          timeout_graceful_shutdown=10.0, lifespan="on", timeout_keep_alive=5,
                          http=head_deadline_protocol(config.request_head_timeout))


def run_server(engine_args: Any, config: ServerConfig) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, shut down gracefully. Returns the exit status."""
    load_chat_template(config.chat_template)  # bad chat flags fail before the model loads, naming the flag
    ChatOptions(enable_auto_tool_choice=config.enable_auto_tool_choice, tool_call_parser=config.tool_call_parser,
                reasoning_parser=config.reasoning_parser)
    sock = bind_socket(config.host, config.port)  # fail fast on a busy port, before loading the model
    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(engine_args, retry_after=config.retry_after)
    if config.log_stats_interval > 0:
        engine.stat_loggers.append(LoggingStatLogger(config.log_stats_interval))
    try:
        app = build_app(engine, config)
    except BaseException:  # a bad --lora-modules adapter: said, and the engine stopped
        engine.shutdown()
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    logger.info("engine ready in %.1f s; serving model %r on http://%s:%d (OpenAI API under /v1)",
                time.monotonic() - t0, app.state.model_names[0], host, port)
    server = _Server(_uvicorn_config(app, config), app, config.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    logger.info("server stopped")
    return 0


class ServerThread:
    """Serve an app from a background thread on a loopback port (port 0: a free one)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 config: Optional[ServerConfig] = None) -> None:
        self.config = config or ServerConfig(uvicorn_log_level="warning", access_log=False, shutdown_timeout=5.0)
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = _Server(_uvicorn_config(app, self.config), app, self.config.shutdown_timeout)
        self.thread = threading.Thread(target=self._run, name="roofline-uvicorn", daemon=True)
        self.error: Optional[BaseException] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # pragma: no cover - surfaced by start()
            self.error = e

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self.error is not None or not self.thread.is_alive():
                raise RuntimeError(f"server failed to start: {self.error}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start in time")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
