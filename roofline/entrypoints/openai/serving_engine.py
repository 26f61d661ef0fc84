"""What the completion and chat handlers share: errors, body parsing, sampling parameters,
logprob formatting, merging several request streams, and SSE framing."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from roofline.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineQueueFullError,
    RequestAbortedError,
    RequestFailedError,
    RequestStream,
)
from roofline.entrypoints.openai.protocol import (
    MAX_LOGPROBS,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from roofline.outputs import CompletionOutput, Logprob, RequestOutput
from roofline.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_PROMPTS_PER_REQUEST = 2048  # OpenAI's limit on a completions request's prompt list
# prompts x n of one request (--max-completions-per-request): lm-eval's batches (n = 1, tens to hundreds
# of prompts) pass; 300 prompts x n = 100 does not tie up the server for minutes
DEFAULT_MAX_COMPLETIONS_PER_REQUEST = 2048
# JSON cannot encode -inf; OpenAI-style servers clamp it.
MIN_LOGPROB = -9999.0


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def engine_error(engine: AsyncLLM, e: BaseException, prompt_field: str = "prompt",
                 request_id: Optional[str] = None) -> APIError:
    """Map an AsyncLLM exception to the HTTP error a client should see.  What the client caused is
    named (400 with the field); what went wrong inside the server is a short message with the request id
    (or an error id), and the details -- exception texts that can hold host names, PIDs, ports and
    collective-library output -- go to the log under that id."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):  # the engine rejected the request: name the field if we can
        msg = str(e)
        return bad_request(msg, param=getattr(e, "param", None) or _param_from_message(msg, prompt_field))
    if isinstance(e, EngineQueueFullError):
        return APIError(503, str(e), "server_busy", None, "queue_full",
                        headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, RequestAbortedError):
        return APIError(503, str(e), "service_unavailable", None, "aborted")
    if isinstance(e, EngineDeadError):
        if engine.dead_error is not None:
            return internal_error(503, "the engine has stopped", "service_unavailable", "engine_dead", e, request_id)
        return APIError(503, "the server is shutting down", "service_unavailable", None, "shutting_down")
    if isinstance(e, RequestFailedError):
        return internal_error(500, "the request failed inside the engine", "internal_server_error", "request_failed",
                              e, request_id)
    return internal_error(500, "internal error", "internal_server_error", None, e, request_id)


def internal_error(status: int, what: str, kind: str, code: Optional[str], e: BaseException,
                   request_id: Optional[str]) -> APIError:
    """A short error for the client (what happened and an id); the exception goes to the log under the id."""
    ref = request_id or random_id("err")
    logger.error("%s (request %s): %s: %s", what, ref, type(e).__name__, e,
                 exc_info=e if not isinstance(e, (EngineDeadError, RequestFailedError)) else None)
    return APIError(status, f"{what} (request {ref}); the server log has the details", kind, None, code)


_PARAM_RE = re.compile(r"(?:sampling parameter|parameter|argument)\s+'?([A-Za-z_]+)'?")


def _param_from_message(msg: str, prompt_field: Optional[str] = None) -> Optional[str]:
    m = _PARAM_RE.search(msg)
    if m:
        return m.group(1)
    if "stop_token_ids" in msg:
        return "stop_token_ids"
    return prompt_field


# --------------------------------------------------------------------------- request bodies
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEAD_TIMEOUT_S = 10.0  # a connection's request head (http_protocol.py)
MAX_JSON_DEPTH = 32  # a chat request nests ~5 levels; anything deeper is an attack or a mistake
_OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are parsed in a thread


async def read_json_body(request: Request, limit: int, timeout: float = DEFAULT_BODY_TIMEOUT_S) -> dict:
    """Read the body (413 past `limit` bytes, 408 if it does not arrive within `timeout` seconds) and
    parse it as one JSON object: 415 unless sent as application/json, 400 for anything that is not
    strict UTF-8 JSON (NaN / Infinity / overflowing numbers, lone surrogates, nesting deeper than
    MAX_JSON_DEPTH)."""
    ctype = request.headers.get("content-type", "")
    media = ctype.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' "
                            f"(got {ctype or 'no Content-Type'!r})", "invalid_request_error", None,
                       "unsupported_media_type")
    too_large = APIError(413, f"request body exceeds the limit of {limit} bytes "
                              "(--max-request-body-bytes)", "invalid_request_error", None,
                         "request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_n = int(declared)
        except ValueError:
            raise bad_request("invalid Content-Length header")
        if declared_n > limit:
            await _drain(request)
            raise too_large

    async def receive() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                await _drain(request)
                raise too_large
        return bytes(body)

    try:
        body = await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", "invalid_request_error",
                       None, "request_timeout")
    if len(body) > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json_object, body)
    return parse_json_object(body)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def parse_json_object(body: bytes) -> dict:
    """Strict JSON -> dict, or a 400 saying what is wrong."""
    try:
        text = body.decode("utf-8")
        obj = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8: {e}", code="invalid_json")
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    except ValueError as e:  # JSONDecodeError too
        raise bad_request(f"malformed JSON in request body: {e}", code="invalid_json")
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    _check_json_values(obj)
    return obj


def _check_json_values(obj: Any) -> None:
    """Depth at most MAX_JSON_DEPTH; every string (keys too) valid Unicode (no lone surrogates)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise bad_request("the request holds a string that is not valid Unicode "
                                      "(a lone surrogate such as \\ud800)", code="invalid_json")
            continue
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
            if isinstance(value, dict):
                stack.extend((k, depth) for k in value)
                stack.extend((v, depth + 1) for v in value.values())
            else:
                stack.extend((v, depth + 1) for v in value)


async def _drain(request: Request) -> None:
    """Discard the rest of an over-limit body so the client gets to read our 413."""
    try:
        async for _ in request.stream():
            pass
    except Exception:
        pass


def parse_model(cls: type[BaseModel], obj: dict) -> Any:
    """Validate a request body; a 400 names the offending field(s)."""
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        by_field: dict[str, list[str]] = {}
        for err in e.errors():
            loc = [str(p) for p in err["loc"]]
            top = loc[0] if loc else "body"
            # For a union field pydantic reports one error per member type; keep the field's path.
            path = ".".join(p for p in loc if not (p and (p[0].islower() and ("[" in p or p in (
                "str", "int", "float", "bool"))))) or top
            by_field.setdefault(top, []).append(f"'{path}': {err['msg']}")
        parts = []
        for top, msgs in by_field.items():
            if len(msgs) > 1 and all(m.startswith(f"'{top}'") for m in msgs):
                parts.append(f"'{top}': invalid value (" + "; ".join(m.split(": ", 1)[1] for m in msgs[:2]) + ")")
            else:
                parts.extend(msgs[:3])
        raise bad_request("invalid request: " + "; ".join(parts), param=next(iter(by_field)))


# --------------------------------------------------------------------------- sampling
def check_request_work(num_prompts: int, n: int, max_completions: int) -> None:
    """A request's work is bounded: at most MAX_PROMPTS_PER_REQUEST prompts, and prompts x n at most
    max_completions (400 beyond, before anything is tokenized or queued)."""
    if num_prompts > MAX_PROMPTS_PER_REQUEST:
        raise bad_request(f"too many prompts in one request: {num_prompts} (at most {MAX_PROMPTS_PER_REQUEST}); "
                          "split them over several requests", param="prompt")
    if num_prompts * n > max_completions:
        raise bad_request(f"too many completions in one request: {num_prompts} prompt(s) x n = {n} is "
                          f"{num_prompts * n} (at most {max_completions}, --max-completions-per-request)",
                          param="n")


def build_sampling_params(req: Any, *, max_tokens: int, logprobs: Optional[int],
                          prompt_logprobs: Optional[int] = None) -> SamplingParams:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if req.n < 1 or req.n > 128:
        raise bad_request(f"n must be between 1 and 128, got {req.n}", param="n")
    if req.use_beam_search and req.stream:
        raise bad_request("use_beam_search does not stream: the beams are ranked when the search ends",
                          param="stream")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"the number of logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}",
                          param="top_logprobs" if hasattr(req, "top_logprobs") else "logprobs")
    kwargs = dict(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA,
        kv_transfer_params=req.kv_transfer_params,
        use_beam_search=req.use_beam_search,
        length_penalty=req.length_penalty,
    )
    if req.use_beam_search:  # the beams rank by the raw model: sampling options do not apply
        kwargs.update(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e)
        raise bad_request(msg, param=_param_from_message(msg))


def resolve_max_tokens(requested: Optional[int], num_prompt_tokens: int, max_model_len: int,
                       prompt_field: str, max_tokens_field: str = "max_tokens") -> int:
    """The output budget: the requested one if it fits, else a 400 naming the lengths."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        if room < 1:
            raise bad_request(
                f"prompt ({num_prompt_tokens} tokens) leaves no room for output within "
                f"max_model_len ({max_model_len})", param=prompt_field, code="context_length_exceeded")
        return room
    if requested < 1:
        raise bad_request(f"{max_tokens_field} must be at least 1, got {requested}", param=max_tokens_field)
    if num_prompt_tokens + requested > max_model_len:
        raise bad_request(
            f"prompt ({num_prompt_tokens} tokens) plus {max_tokens_field} ({requested}) exceeds "
            f"max_model_len ({max_model_len})", param=prompt_field, code="context_length_exceeded")
    return requested


# --------------------------------------------------------------------------- logprobs
def clamp_logprob(x: Optional[float]) -> Optional[float]:
    if x is None:
        return None
    if math.isnan(x):
        return MIN_LOGPROB
    return max(float(x), MIN_LOGPROB)


def token_text(tokenizer: Any, token_id: int, lp: Optional[Logprob]) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def top_entries(d: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely entries of one position's logprobs, most likely first."""
    if k <= 0:
        return []
    items = list(d.items())
    if all(v.rank is not None for _, v in items):
        items.sort(key=lambda kv: kv[1].rank)
    else:
        items.sort(key=lambda kv: -kv[1].logprob)
    return items[:k]


# --------------------------------------------------------------------------- usage / choices
@dataclass
class ChoiceState:
    """What one choice (one completion of one prompt) has accumulated."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # position dicts, in order
    finish_reason: Optional[str] = None
    stop_reason: Any = None


def make_usage(prompt_lens: Sequence[int], completion_tokens: int, cached: int) -> UsageInfo:
    prompt_tokens = sum(prompt_lens)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def check_finish(comp: CompletionOutput) -> None:
    if comp.finish_reason == "abort":
        raise RequestAbortedError("the request was aborted by the server")


def stop_reason_value(v: Any) -> Any:
    return v if isinstance(v, (int, str)) or v is None else str(v)


# --------------------------------------------------------------------------- submitting and merging
async def submit_all(engine: AsyncLLM, base_id: str, prompts: Sequence[tuple[Optional[str], list[int]]],
                     params: SamplingParams, priority: int, prompt_field: str = "prompt",
                     lora_request: Any = None) -> list[RequestStream]:
    """Submit one engine request per prompt (under the LoRA adapter lora_request, if any); if any is
    rejected, abort the others and raise."""
    streams: list[RequestStream] = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await engine.add_request(rid, ids, params.clone() if i else params,
                                                    prompt=text, priority=priority, lora_request=lora_request))
    except BaseException as e:
        for s in streams:
            s.close()
        if isinstance(e, ValueError) and lora_request is not None and str(e).startswith("LoRA adapter"):
            raise bad_request(str(e), param="model") from e  # the adapter the request names cannot run
        if isinstance(e, Exception):
            raise engine_error(engine, e, prompt_field, base_id) from e
        raise
    return streams


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from several streams as they arrive; closes them all at the end."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, done))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.close()


async def close_all(streams: Sequence[RequestStream], merged: Any) -> None:
    """Deterministic cleanup for a handler that stops early (client gone, error): abort now."""
    for s in streams:
        s.close()
    try:
        await merged.aclose()
    except Exception:
        pass


def sse(data: Any) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEStream:
    """A streaming answer: the SSE generator plus the engine streams behind it, so the HTTP layer
    can abort them even if the generator never started (client gone before the first byte)."""

    def __init__(self, agen: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        self.agen = agen
        self.streams = list(streams)

    def __aiter__(self) -> AsyncIterator[str]:
        return self.agen

    async def aclose(self) -> None:
        for s in self.streams:
            s.close()
        try:
            await self.agen.aclose()  # type: ignore[attr-defined]
        except Exception:
            pass


def sse_error(err: APIError) -> str:
    return sse(err.to_response())


def server_tokenizer(tokenizer: Any) -> Any:
    """A private copy of the tokenizer for the event-loop thread (the engine thread uses its own):
    Rust tokenizers raise "Already borrowed" when two threads touch one instance at once."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:
        return tokenizer
