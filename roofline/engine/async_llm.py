"""AsyncLLM: the engine as the API server sees it.

EngineCore is not thread-safe, so exactly one thread (the *engine thread*) ever touches it. The
event loop talks to that thread through a command list guarded by a condition variable:

    event loop                          engine thread
    add_request() ── _Add ──────────▶  drain commands: core.add_request / core.abort_requests
        ◀── accepted / ValueError ──    core.step() while there is work, else block on the condition
    RequestStream ◀── RequestOutputs ─  one loop.call_soon_threadsafe per iteration and event loop

A request joins the batch at the next iteration. A consumer that stops iterating (a client that
disconnects, a cancelled task) aborts its request, which frees its KV blocks in the core. If the
engine thread dies, every in-flight request gets `EngineDeadError` and `is_healthy` turns False.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Sequence

from roofline.engine.errors import RequestInvalidError
from roofline.metrics.stats import FinishedRequestStats, IterationStats, StatLogger
from roofline.outputs import RequestOutput
from roofline.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped (crashed or shut down); no request can be served."""


class EngineQueueFullError(RuntimeError):
    """Too many requests are waiting; the client should retry later."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestAbortedError(RuntimeError):
    """The request was aborted by the server (shutdown) before it finished."""


class RequestFailedError(RuntimeError):
    """The engine reported a per-request error (RequestOutput.error)."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Optional[str]
    priority: int
    arrival_time: float
    stream: "RequestStream"
    lora_request: Any = None  # lora/request.LoRARequest: the adapter it runs under


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _AbortAll:
    error: BaseException  # what every in-flight request's stream raises


@dataclass
class _ReqState:
    """Engine-thread bookkeeping for one request (metrics; where to deliver outputs)."""

    stream: "RequestStream"
    arrival_time: float
    num_prompt_tokens: int
    output_kind: RequestOutputKind
    first_token_time: Optional[float] = None
    last_token_time: dict[int, float] = field(default_factory=dict)  # per completion index
    num_tokens: dict[int, int] = field(default_factory=dict)  # per completion index


class RequestStream:
    """Async iterator over the RequestOutputs of one request; ends after the finished output.

    Closing it (`close()`, or leaving an `async for` early through `generate`) before the request
    finishes aborts the request in the engine.
    """

    def __init__(self, engine: "AsyncLLM", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.finished = False  # the final output (or an error) was consumed, or close() was called
        self._closed = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._accepted: asyncio.Future = loop.create_future()

    # -- called in the event loop thread (scheduled by the engine thread) --
    def _put(self, item: Any) -> None:
        if not self._closed:
            self._queue.put_nowait(item)

    def _resolve(self, error: Optional[BaseException]) -> None:
        if self._accepted.done():
            return
        if error is None:
            self._accepted.set_result(None)
        else:
            self._accepted.set_exception(error)

    # -- consumer side --
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed or (self.finished and self._queue.empty()):
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self.finished:
            self.engine.abort_nowait(self.request_id)
        self.finished = self._closed = True


class AsyncLLM:
    def __init__(
        self,
        core: Any,
        *,
        max_waiting_requests: Optional[int] = None,
        stat_loggers: Sequence[StatLogger] = (),
        retry_after: int = 1,
    ) -> None:
        self.core = core
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers: list[StatLogger] = list(stat_loggers)
        self.retry_after = retry_after
        self._cond = threading.Condition()
        self._commands: list[Any] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._accepting = True  # guarded by _cond; False once the engine thread stops taking commands
        self._dead: Optional[BaseException] = None
        self._states: dict[str, _ReqState] = {}  # engine thread only
        self._has_work = False  # engine thread only
        self.idle_health_interval = 1.0  # seconds between worker health checks while idle
        self._added_since_stats = 0  # engine thread only
        self._last_stats: Any = None
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="roofline-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> "AsyncLLM":
        from roofline.engine.engine_core import EngineCore

        # The core enforces max_waiting_requests itself (EngineOverloadedError -> EngineQueueFullError).
        config = engine_args.create_engine_config()
        if config.engine_core_process:  # the core in a process of its own, same methods
            from roofline.engine.core_process import EngineCoreClient

            return cls(EngineCoreClient(config), **kwargs)
        return cls(EngineCore(config), **kwargs)

    # ------------------------------------------------------------------ public API (event loop)
    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def model_config(self) -> Any:
        return self.core.model_config

    @property
    def lora_config(self) -> Any:
        """The engine's LoRAConfig (None: it serves no adapters)."""
        config = getattr(self.core, "config", None)
        return getattr(config, "lora_config", None)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead

    def get_stats(self) -> Any:
        """The core's EngineStats as of the end of the last engine iteration."""
        return self._last_stats

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: Optional[str] = None,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        lora_request: Any = None,
    ) -> RequestStream:
        """Submit a request; returns once the engine accepted it.

        Raises ValueError (invalid request), EngineQueueFullError or EngineDeadError.
        """
        self._check_alive()
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        cmd = _Add(request_id, list(prompt_token_ids), params, prompt, priority,
                   arrival_time if arrival_time is not None else time.monotonic(), stream, lora_request)
        self._submit(cmd)
        try:
            await stream._accepted
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            stream.finished = True
            raise
        return stream

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        prompt: Optional[str] = None,
        priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs until the request finishes; stopping early aborts it."""
        stream = await self.add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                        priority=priority, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Thread-safe; the request is aborted at the start of the next iteration."""
        if self._dead is None:
            self._submit(_Abort([request_id]))

    def num_in_flight(self) -> int:
        """Requests accepted or waiting to be, not yet finished (thread-safe, a snapshot)."""
        with self._cond:
            pending = sum(1 for c in self._commands if isinstance(c, _Add))
        return len(self._states) + pending

    def abort_all_nowait(self, error: BaseException) -> None:
        """Abort every request in flight; each stream raises `error` (thread-safe)."""
        if self._dead is None:
            self._submit(_AbortAll(error))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort in-flight requests and stop the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        with self._cond:
            if self._stopping:
                raise EngineDeadError("engine is shutting down")

    def _submit(self, cmd: Any) -> None:
        with self._cond:
            accepting = self._accepting
            if accepting:
                self._commands.append(cmd)
                self._cond.notify()
        if not accepting and isinstance(cmd, _Add):  # the engine thread is gone: fail now, in this loop
            cmd.stream._resolve(EngineDeadError(f"engine is not running: {self._dead or 'shut down'}"))

    def _refresh_stats(self) -> None:
        try:
            self._last_stats = self.core.get_stats()
        except Exception:  # a core without stats still serves
            logger.debug("get_stats failed", exc_info=True)
            self._last_stats = None
        self._added_since_stats = 0

    def _num_waiting(self) -> int:
        waiting = getattr(self._last_stats, "num_waiting", 0) or 0
        return waiting + self._added_since_stats

    @staticmethod
    def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed: nobody is listening any more
            return False

    def _run(self) -> None:
        try:
            while True:
                idle_check = False
                with self._cond:
                    while not self._commands and not self._stopping and not self._has_work:
                        if not self._cond.wait(timeout=self.idle_health_interval):
                            idle_check = True  # idle: look at the workers once a second
                            break
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                    if stopping:
                        self._accepting = False
                if stopping:
                    self._fail_commands(commands, EngineDeadError("engine is shutting down"))
                    self._abort_all(RequestAbortedError("the server is shutting down"))
                    self._shutdown_core()
                    return
                if idle_check and not commands:
                    check = getattr(self.core, "check_health", None)
                    if check is not None:
                        check()  # a dead tensor-parallel rank makes the server unhealthy while idle
                    continue
                it = IterationStats(timestamp=0.0)
                self._process_commands(commands, it)
                outputs: list[RequestOutput] = []
                if self.core.has_unfinished_requests():
                    outputs = self.core.step()
                    self._dispatch(outputs, it)
                self._has_work = self.core.has_unfinished_requests()
                self._refresh_stats()
                it.timestamp = time.monotonic()
                it.engine = self._last_stats
                for sl in self.stat_loggers:
                    try:
                        sl.record(it)
                    except Exception:
                        logger.exception("stat logger %r failed", sl)
        except BaseException as e:  # the core is in an unknown state: stop serving
            logger.exception("engine loop died")
            self._dead = e
            err = EngineDeadError(f"engine loop died: {type(e).__name__}: {e}")
            with self._cond:
                commands, self._commands = self._commands, []
                self._accepting = False
            self._fail_commands(commands, err)
            # a dead executor leaves the core's own state whole (ExecutorDeadError.core_state_intact): abort its
            # requests there too, so every KV block is back in the pool; any other failure leaves the core alone
            self._abort_all(err, call_core=getattr(e, "core_state_intact", False))
            self._shutdown_core()

    def _shutdown_core(self) -> None:
        """Release what the core holds beyond this process (executor worker processes)."""
        shutdown = getattr(self.core, "shutdown", None)
        if shutdown is None:
            return
        try:
            shutdown()
        except Exception:
            logger.exception("core shutdown failed")

    def _fail_commands(self, commands: Iterable[Any], err: BaseException) -> None:
        for cmd in commands:
            if isinstance(cmd, _Add):
                self._call_in_loop(cmd.stream.loop, cmd.stream._resolve, err)

    def _abort_all(self, err: BaseException, call_core: bool = True) -> None:
        ids = list(self._states)
        if call_core and ids:
            try:
                self.core.abort_requests(ids)
            except Exception:
                logger.exception("abort during shutdown failed")
        now = time.monotonic()
        it = IterationStats(timestamp=now)
        for rid in ids:
            st = self._states.pop(rid)
            self._call_in_loop(st.stream.loop, st.stream._put, err)
            it.finished.append(self._finished_stats(st, "abort", now, None))
        if call_core:
            self._refresh_stats()
            it.engine = self._last_stats
        for sl in self.stat_loggers:
            try:
                sl.record(it)
            except Exception:
                logger.exception("stat logger %r failed", sl)

    def _process_commands(self, commands: list[Any], it: IterationStats) -> None:
        to_abort: list[str] = []
        now = time.monotonic()
        for cmd in commands:
            if isinstance(cmd, _AbortAll):
                if to_abort:
                    self.core.abort_requests(to_abort)
                    to_abort = []
                self._abort_all(cmd.error)
                continue
            if isinstance(cmd, _Abort):
                for rid in cmd.request_ids:
                    st = self._states.pop(rid, None)
                    if st is not None:
                        to_abort.append(rid)
                        it.finished.append(self._finished_stats(st, "abort", now, None))
                continue
            error: Optional[BaseException] = None
            if self.max_waiting_requests is not None and self._num_waiting() >= self.max_waiting_requests:
                error = EngineQueueFullError(
                    f"the server is busy: {self._num_waiting()} requests are waiting "
                    f"(--max-waiting-requests {self.max_waiting_requests}); retry later",
                    retry_after=self.retry_after,
                )
            else:
                try:
                    self.core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params,
                                          prompt=cmd.prompt, arrival_time=cmd.arrival_time,
                                          priority=cmd.priority,
                                          **({"lora_request": cmd.lora_request} if cmd.lora_request else {}))
                except (ValueError, TypeError) as e:
                    error = ValueError(str(e))
                except Exception as e:
                    if type(e).__name__ == "EngineOverloadedError":  # the core's waiting queue is full
                        error = EngineQueueFullError(f"the server is busy: {e}; retry later",
                                                     retry_after=self.retry_after)
                    else:
                        logger.exception("add_request(%s) failed", cmd.request_id)
                        error = RequestFailedError(f"could not add the request: {type(e).__name__}: {e}")
            if error is None:
                self._added_since_stats += 1
                self._states[cmd.request_id] = _ReqState(
                    stream=cmd.stream, arrival_time=cmd.arrival_time,
                    num_prompt_tokens=len(cmd.prompt_token_ids), output_kind=cmd.params.output_kind)
                it.num_new_prompt_tokens += len(cmd.prompt_token_ids)
            if not self._call_in_loop(cmd.stream.loop, cmd.stream._resolve, error) and error is None:
                st = self._states.pop(cmd.request_id)
                to_abort.append(cmd.request_id)
                it.finished.append(self._finished_stats(st, "abort", now, None))
        if to_abort:
            self.core.abort_requests(to_abort)

    @staticmethod
    def _finished_stats(st: _ReqState, reason: str, now: float, out: Optional[RequestOutput]) -> FinishedRequestStats:
        m = out.metrics if out is not None else None
        queue_time = None
        if m is not None and m.first_scheduled_time is not None:
            queue_time = max(0.0, m.first_scheduled_time - st.arrival_time)
        ttft = None if st.first_token_time is None else st.first_token_time - st.arrival_time
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=max(0.0, now - st.arrival_time),
            queue_time=queue_time,
            ttft=ttft,
            num_prompt_tokens=st.num_prompt_tokens,
            num_generation_tokens=sum(st.num_tokens.values()),
        )

    def _dispatch(self, outputs: list[RequestOutput], it: IterationStats) -> None:
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for out in outputs:
            st = self._states.get(out.request_id)
            if st is None:  # aborted by us already, or not ours
                continue
            self._track(st, out, now, it)
            item: Any = out
            if out.error:
                item = (RequestInvalidError(out.error, out.error_param) if out.error_param
                        else RequestFailedError(out.error))
            done = out.finished or out.error is not None
            if done:
                del self._states[out.request_id]
                reason = "error" if out.error else next(
                    (c.finish_reason for c in out.outputs if c.finish_reason), "stop")
                it.finished.append(self._finished_stats(st, reason, now, out))
            batches.setdefault(st.stream.loop, []).append((st.stream, item))
        for loop, items in batches.items():
            if not self._call_in_loop(loop, _deliver, items):
                for stream, item in items:
                    if not (isinstance(item, RequestOutput) and item.finished):
                        self.abort_nowait(stream.request_id)

    def _track(self, st: _ReqState, out: RequestOutput, now: float, it: IterationStats) -> None:
        for comp in out.outputs:
            count = len(comp.token_ids)
            if st.output_kind == RequestOutputKind.DELTA:
                new = count
                st.num_tokens[comp.index] = st.num_tokens.get(comp.index, 0) + count
            else:
                new = count - st.num_tokens.get(comp.index, 0)
                st.num_tokens[comp.index] = count
            if new <= 0:
                continue
            it.num_new_generation_tokens += new
            if st.first_token_time is None:
                ftt = getattr(out.metrics, "first_token_time", None) if out.metrics else None
                st.first_token_time = ftt if ftt is not None and ftt >= st.arrival_time else now
                it.ttfts.append(st.first_token_time - st.arrival_time)
            last = st.last_token_time.get(comp.index)
            if last is not None:
                gap = (now - last) / new
                it.itls.extend([gap] * new)
            elif new > 1:
                it.itls.extend([0.0] * (new - 1))
            st.last_token_time[comp.index] = now


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)
