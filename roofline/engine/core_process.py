"""EngineCore in a process of its own, and the client the server's AsyncLLM drives in its place.

    server process (HTTP, tokenization)              engine core process (python -m roofline.engine.core_process)
    AsyncLLM engine thread ── AddRequest ───────────▶  core.add_request ── Added (error or None) ──▶
                           ── AbortRequests ────────▶  core.abort_requests
                           ◀── StepOutputs ─────────  core.step() in a loop while there is work: outputs,
                                                       stats, whether work is left, commands taken so far

Messages are msgspec Structs as msgpack bytes over a socket pair (never pickle).  The core process
steps on its own: while the server's engine thread dispatches step n's outputs to the HTTP streams,
the core already runs step n+1, and the server's GIL never stalls a step.  `EngineCoreClient` has
the methods AsyncLLM calls on an EngineCore, so AsyncLLM is the same for both.

Faults: a core process that dies, or whose step raises, turns the client dead: step() and
check_health() raise EngineCoreDeadError naming the cause (AsyncLLM then fails every request).  The
core process exits when its parent's socket closes.  Errors while starting (a bad model path, a
tensor-parallel split that does not fit) come back with their type (ValueError stays ValueError).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import time
from typing import Any, Iterable, Optional, Union

import msgspec

from roofline.config import EngineConfig, ModelConfig
from roofline.engine.errors import RequestInvalidError
from roofline.executor.base import ExecutorDeadError
from roofline.lora_request import LoRARequest
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams
from roofline.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

IDLE_HEALTH_INTERVAL_S = 1.0  # the core process checks its workers this often while idle
STARTUP_TIMEOUT_S = 1800.0  # loading a model (and starting its ranks) may take long
SHUTDOWN_GRACE_S = 15.0


class EngineCoreDeadError(ExecutorDeadError):
    """The engine core process died or failed; the server cannot serve any more requests."""

    core_state_intact = False  # the core (and its pool) went with its process


# ---- server -> core ---------------------------------------------------------------------------------
class CoreStart(msgspec.Struct):
    config: EngineConfig  # as EngineArgs made it (model_config.hf_config is None)
    log_level: int = logging.INFO


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: Optional[str]
    arrival_time: Optional[float]  # time.monotonic() (one clock for every process of the machine)
    priority: int
    cache_salt: Optional[str]
    lora_request: Optional[LoRARequest] = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class ShutdownCore(msgspec.Struct, tag="shutdown", array_like=True):
    pass


# ---- core -> server ---------------------------------------------------------------------------------
class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    model_config: ModelConfig  # finalized (max_model_len, served_model_name, paths); hf_config None
    hf_config_json: str


class Added(msgspec.Struct, tag="added", array_like=True):
    request_id: str
    error_type: Optional[str] = None  # ValueError | EngineOverloadedError | another exception's name
    error: Optional[str] = None


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[RequestOutput]
    stats: Any  # EngineStats as a dict (msgspec-encoded dataclass)
    has_unfinished: bool
    commands_taken: int  # AddRequest + AbortRequests handled before this message


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    error_type: str
    message: str


ToCore = Union[AddRequest, AbortRequests, ShutdownCore]
FromCore = Union[CoreReady, Added, StepOutputs, CoreFailed]

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
start_decoder = msgspec.msgpack.Decoder(CoreStart)


def _stats_from(raw: Any):
    from roofline.engine.engine_core import EngineStats

    return msgspec.convert(raw, EngineStats) if raw is not None else None


def _unencodable_field(msg: AddRequest) -> str:
    """The request field whose value msgpack cannot encode (prompt, priority or a sampling parameter)."""
    fields = [("prompt", msg.prompt_token_ids), ("priority", msg.priority)]
    fields += [(f.name, getattr(msg.params, f.name)) for f in dataclasses.fields(msg.params)]
    for name, value in fields:
        try:
            encoder.encode(value)
        except (OverflowError, TypeError, msgspec.EncodeError):
            return name
    return "prompt"


# ---- the core process ---------------------------------------------------------------------------------
class CoreProcess:
    """The loop of the engine core process: take commands, step while there is work, send outputs."""

    def __init__(self, core: Any, conn) -> None:
        self.core = core
        self.conn = conn
        self.commands_taken = 0

    def send(self, msg) -> None:
        self.conn.send_bytes(encoder.encode(msg))

    def handle(self, msg) -> bool:
        """One command; False on ShutdownCore."""
        if isinstance(msg, ShutdownCore):
            return False
        self.commands_taken += 1
        if isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
            return True
        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, prompt=msg.prompt,
                                  arrival_time=msg.arrival_time, priority=msg.priority, cache_salt=msg.cache_salt,
                                  lora_request=msg.lora_request)
        except Exception as e:  # the request alone is refused (ValueError's kinds, a bad LoRA adapter's, as ValueError)
            self.send(Added(msg.request_id, "ValueError" if isinstance(e, ValueError) else type(e).__name__, str(e)))
        else:
            self.send(Added(msg.request_id))
        return True

    def refuse_invalid(self, data: bytes, error: Exception) -> None:
        """An AddRequest that decodes but does not validate (SamplingParams.__post_init__ refused it) is
        answered like any refused request; anything else that does not decode is a protocol fault."""
        raw = msgspec.msgpack.decode(data)
        if not (isinstance(raw, list) and len(raw) > 1 and raw[0] == "add" and isinstance(raw[1], str)):
            raise error
        self.commands_taken += 1
        self.send(Added(raw[1], "ValueError", str(error).split(" - at `")[0]))

    def run(self) -> None:
        core = self.core
        while True:
            busy = core.has_unfinished_requests()
            took = 0
            timeout = 0.0 if busy else IDLE_HEALTH_INTERVAL_S
            while self.conn.poll(timeout):
                try:
                    data = self.conn.recv_bytes()
                except (EOFError, OSError):
                    logger.warning("the server is gone; the engine core stops")
                    return
                try:
                    msg = to_core_decoder.decode(data)
                except msgspec.ValidationError as e:  # a request whose parameters do not validate: refused alone
                    self.refuse_invalid(data, e)
                    took += 1
                    continue
                if not self.handle(msg):
                    return
                took += 1
                timeout = 0.0
            if not took and not busy:
                core.check_health()  # idle: a dead worker shows now, not on the next request
                continue
            outputs = core.step() if core.has_unfinished_requests() else []
            self.send(StepOutputs(outputs, msgspec.to_builtins(core.get_stats()), core.has_unfinished_requests(),
                                  self.commands_taken))


def run_core_process(start: CoreStart, conn) -> int:
    from roofline.distributed.protocol import encode_hf_config
    from roofline.engine.engine_core import EngineCore

    logging.basicConfig(level=start.log_level, format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    try:
        core = EngineCore(start.config)
    except BaseException as e:
        logger.exception("the engine core failed to start")
        try:
            conn.send_bytes(encoder.encode(CoreFailed(type(e).__name__, str(e))))
        except OSError:
            pass
        return 1
    mc = core.model_config
    ready = CoreReady(ModelConfig(**{**{f: getattr(mc, f) for f in ModelConfig.__dataclass_fields__}, "hf_config": None}),
                      encode_hf_config(mc.hf_config))
    code = 0
    try:
        conn.send_bytes(encoder.encode(ready))
        CoreProcess(core, conn).run()
    except (EOFError, OSError):
        logger.warning("lost the connection to the server; the engine core stops")
    except BaseException as e:
        logger.exception("the engine core failed")
        code = 1
        try:
            conn.send_bytes(encoder.encode(CoreFailed(type(e).__name__, str(e))))
        except OSError:
            pass
    finally:
        core.shutdown()
    return code


def main(argv: Optional[list[str]] = None) -> int:
    from multiprocessing.connection import Connection

    parser = argparse.ArgumentParser(description="the engine core (started by the server, not by hand)")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the socket to the server")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when we stop (Ctrl-C reaches it too)
    conn = Connection(args.fd)
    try:
        start = start_decoder.decode(conn.recv_bytes())
    except (EOFError, OSError, msgspec.DecodeError) as e:
        print(f"roofline engine core: no valid start message from the server: {e}", file=sys.stderr)
        return 2
    return run_core_process(start, conn)


# ---- the server's side ----------------------------------------------------------------------------------
class EngineCoreClient:
    """What AsyncLLM drives when the engine core runs in its own process (same methods as EngineCore).
    Not thread-safe: AsyncLLM calls it from its engine thread alone."""

    def __init__(self, config: EngineConfig) -> None:
        from roofline.distributed.protocol import decode_hf_config, describe_exit, start_child_process
        from roofline.model_executor.loader.source import load_tokenizer, resolve_source

        self._describe_exit = describe_exit
        self.proc, self.conn = start_child_process(
            "roofline.engine.core_process", encoder.encode(CoreStart(config, logging.getLogger("roofline").getEffectiveLevel())))
        self._dead: Optional[str] = None
        self._closed = False
        self._buffered: list[StepOutputs] = []
        self._last: Optional[StepOutputs] = None
        self._stats_records: list = []
        self._commands_sent = 0
        try:
            msg = self._recv(STARTUP_TIMEOUT_S, "start-up")
        except BaseException:
            self._kill()
            raise
        if isinstance(msg, CoreFailed):
            self._kill()
            raise (ValueError if msg.error_type == "ValueError" else RuntimeError)(msg.message)
        if not isinstance(msg, CoreReady):
            self._kill()
            raise RuntimeError(f"the engine core sent {type(msg).__name__} before it was ready")
        self.model_config = msg.model_config
        self.model_config.hf_config = decode_hf_config(msg.hf_config_json)
        self.config = config
        self.tokenizer = load_tokenizer(resolve_source(self.model_config.model, self.model_config.load_format),
                                        self.model_config.tokenizer)
        # the server compiles a request's grammar before accepting it (a bad one is a 400, not a failed
        # request); the core compiles it again in its own process, where the matchers run
        self.structured_output = StructuredOutputManager(self.tokenizer, int(self.model_config.hf_config.vocab_size))

    # ---- plumbing ----------------------------------------------------------------------------------
    def _fail(self, message: str) -> EngineCoreDeadError:
        if self._dead is None:
            self._dead = message
            logger.error("engine core failed: %s", message)
            self._kill()
        return EngineCoreDeadError(self._dead)

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _exit_reason(self) -> str:
        try:
            self.proc.wait(timeout=2.0)
        except Exception:
            pass
        return f"the engine core process (pid {self.proc.pid}) {self._describe_exit(self.proc)}"

    def _recv(self, timeout: Optional[float], what: str):
        """The next message from the core; raises EngineCoreDeadError when the core is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None and not self.conn.poll(0):
                raise self._fail(self._exit_reason())
            if deadline is not None and time.monotonic() > deadline:
                raise self._fail(f"the engine core did not answer within {timeout:.0f} s ({what})")
        try:
            msg = from_core_decoder.decode(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self._fail(self._exit_reason()) from None
        if isinstance(msg, CoreFailed) and what != "start-up":
            raise self._fail(f"the engine core failed: {msg.error_type}: {msg.message}")
        return msg

    def _send(self, msg) -> None:
        """Send a message (or its encoded bytes)."""
        if self._dead is not None:
            raise EngineCoreDeadError(self._dead)
        try:
            self.conn.send_bytes(msg if isinstance(msg, bytes) else encoder.encode(msg))
        except OSError:
            raise self._fail(self._exit_reason()) from None

    def _take(self, msg: StepOutputs) -> None:
        self._buffered.append(msg)
        self._last = msg
        stats = msg.stats or {}
        self._stats_records.extend(stats.get("step_roofline") or [])

    # ---- what AsyncLLM calls -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: Optional[str] = None, arrival_time: Optional[float] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> None:
        from roofline.engine.engine_core import EngineOverloadedError

        msg = AddRequest(request_id, list(prompt_token_ids), params, prompt,
                         time.monotonic() if arrival_time is None else arrival_time, priority, cache_salt,
                         lora_request)
        try:  # a value msgpack cannot carry (an integer past 64 bits, in a schema say) rejects the request
            data = encoder.encode(msg)
        except (OverflowError, TypeError, msgspec.EncodeError) as e:
            field = _unencodable_field(msg)
            raise RequestInvalidError(f"{field} holds a value the engine cannot take: {e}", field) from None
        self._send(data)
        self._commands_sent += 1
        while True:
            msg = self._recv(None, "add_request")
            if isinstance(msg, StepOutputs):
                self._take(msg)
                continue
            if not isinstance(msg, Added) or msg.request_id != request_id:
                raise self._fail(f"the engine core answered add_request({request_id}) with {msg!r}")
            break
        if msg.error_type is None:
            return
        if msg.error_type == "ValueError":
            raise ValueError(msg.error)
        if msg.error_type == "EngineOverloadedError":
            raise EngineOverloadedError(msg.error)
        raise RuntimeError(f"{msg.error_type}: {msg.error}")

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._send(AbortRequests(list(request_ids)))
        self._commands_sent += 1

    def has_unfinished_requests(self) -> bool:
        if self._buffered:
            return True
        if self._last is not None and self._last.commands_taken >= self._commands_sent:
            return self._last.has_unfinished
        return self._commands_sent > 0  # the core owes a StepOutputs for the commands it has not taken yet

    def step(self) -> list[RequestOutput]:
        """Every output the core produced since the last call; waits for the next step when there is none."""
        if not self._buffered and self.has_unfinished_requests():
            while True:
                msg = self._recv(None, "step")
                if isinstance(msg, StepOutputs):
                    self._take(msg)
                    break
                raise self._fail(f"unexpected {type(msg).__name__} from the engine core")
        while self.conn.poll(0):  # take whatever else has arrived (the core runs ahead)
            msg = self._recv(0, "step")
            if not isinstance(msg, StepOutputs):
                raise self._fail(f"unexpected {type(msg).__name__} from the engine core")
            self._take(msg)
        outputs = [o for m in self._buffered for o in m.outputs]
        self._buffered = []
        return outputs

    def get_stats(self):
        if self._last is None:
            return None
        raw = dict(self._last.stats)
        raw["step_roofline"], self._stats_records = self._stats_records, []
        return _stats_from(raw)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineCoreDeadError(self._dead)
        if self._closed:
            raise EngineCoreDeadError("the engine core was shut down")
        while self.conn.poll(0):  # a CoreFailed may be waiting
            msg = self._recv(0, "health")
            if isinstance(msg, StepOutputs):
                self._take(msg)
        if self.proc.poll() is not None:
            raise self._fail(self._exit_reason())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.structured_output.shutdown()
        if self._dead is None and self.proc.poll() is None:
            try:
                self.conn.send_bytes(encoder.encode(ShutdownCore()))
                self.proc.wait(timeout=SHUTDOWN_GRACE_S)
            except Exception:
                logger.warning("the engine core did not stop in %.0f s; killing it", SHUTDOWN_GRACE_S)
        self._kill()
        self.conn.close()


if __name__ == "__main__":
    sys.exit(main())
