"""Messages between the engine, the worker processes and their launchers.

All msgspec Structs sent as msgpack bytes (over a local socket pair between a process and the
worker processes it started, and over the gloo control group between ranks); never pickle.

    engine ──Execute / Call / Shutdown──▶ rank 0 ──(same bytes, control broadcast)──▶ ranks 1..N-1
    engine ◀──Output / Result / Failure── rank 0           every rank ──Ready / Failure──▶ its parent
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import msgspec

from roofline.config import EngineConfig
from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

DEFAULT_WORKER_CLS = "roofline.worker.worker:Worker"
HEARTBEAT_INTERVAL_S = 0.5


class WorkerSpec(msgspec.Struct):
    """Everything a worker process needs before it joins the world (sent first on its socket)."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    nnodes: int
    master_addr: str  # rank 0 serves the rendezvous store on this address alone
    master_port: int
    secret: str  # the launch's shared secret: joining the world needs it
    backend: str  # gloo | nccl (model collectives)
    device: str  # this node's device type: cpu | cuda
    timeout_s: float  # model-collective and rendezvous timeout
    num_threads: int
    log_level: int = 20
    show_progress: bool = False
    worker_cls: str = DEFAULT_WORKER_CLS  # "module:Class"
    bootstrap: Optional[bytes] = None  # rank 0 only: the encoded Bootstrap it broadcasts
    model_override: Optional[str] = None  # this node's path to the checkpoint (multi-node)


class Bootstrap(msgspec.Struct):
    """Rank 0 -> all ranks after rendezvous: the engine's (already finalized) configuration."""

    config: EngineConfig  # model_config.hf_config is None here; it travels as JSON below
    model: Optional[str]  # the model argument as the user gave it; each rank resolves it locally
    hf_config_json: str  # the engine's HF config as a ConfigSnapshot's JSON: ranks never import transformers


class RankStatus(msgspec.Struct):
    rank: int
    host: str
    pid: int
    error: Optional[str]


# ---- engine -> rank 0 -> every rank ----------------------------------------------------------------
class Execute(msgspec.Struct, tag="x", array_like=True):
    out: SchedulerOutput


class Call(msgspec.Struct, tag="c", array_like=True):
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="s", array_like=True):
    pass


# ---- a worker -> its parent ------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    rank: int
    info: str


class Output(msgspec.Struct, tag="o", array_like=True):
    out: ModelRunnerOutput


class Result(msgspec.Struct, tag="r", array_like=True):
    value: Any


class Failure(msgspec.Struct, tag="f", array_like=True):
    rank: int
    message: str
    startup: bool


class Heartbeat(msgspec.Struct, tag="h", array_like=True):
    """Sent by every rank to its parent every HEARTBEAT_INTERVAL_S from a thread of its own: when they
    stop, the rank is hung or stopped (SIGSTOP), even while the engine is idle."""

    rank: int


Request = Union[Execute, Call, Shutdown]
Reply = Union[Ready, Output, Result, Failure, Heartbeat]

encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
spec_decoder = msgspec.msgpack.Decoder(WorkerSpec)
bootstrap_decoder = msgspec.msgpack.Decoder(Bootstrap)
status_decoder = msgspec.msgpack.Decoder(RankStatus)


def encode_bootstrap(config: EngineConfig) -> bytes:
    mc = replace(config.model_config, hf_config=None)
    return encoder.encode(Bootstrap(config=replace(config, model_config=mc), model=mc.model,
                                    hf_config_json=encode_hf_config(config.model_config.hf_config)))


def encode_hf_config(hf_config: Any) -> str:
    """An HF config (a ConfigSnapshot, or a transformers config given directly) for another process."""
    from roofline.hf_config import snapshot

    return snapshot(hf_config).to_json()


def decode_hf_config(hf_config_json: str):
    from roofline.hf_config import ConfigSnapshot

    return ConfigSnapshot.from_json(hf_config_json)


# ---- starting worker processes ---------------------------------------------------------------------
class RankHandle:
    """One rank as its watcher sees it: a connection (send_bytes/recv_bytes of msgpack messages) and the
    process behind it.  LocalProcess (a child process of this one) and the Ray executor's actors
    implement it; launch.RankGroup watches any of them the same way."""

    rank: int
    conn: Any

    def describe(self) -> str:
        """Which rank, and where ("rank 1 (pid 123)")."""
        raise NotImplementedError

    def exit_status(self) -> Optional[str]:
        """None while the rank's process runs; else how it ended ("was killed by SIGKILL").  No I/O."""
        raise NotImplementedError

    def stopped(self) -> bool:
        """The process is stopped (SIGSTOP or a debugger): it cannot send heartbeats."""
        return False

    def wait(self, timeout: float) -> bool:
        """Wait up to timeout seconds for the process to end; True once it has."""
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError


@dataclass
class LocalProcess(RankHandle):
    """One worker process started by this process, and the socket to it."""

    rank: int
    proc: subprocess.Popen
    conn: Any  # multiprocessing.connection.Connection over a socket pair (send_bytes/recv_bytes only)

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.proc.pid})"

    def exit_status(self) -> Optional[str]:
        return None if self.proc.poll() is None else describe_exit(self.proc)

    def stopped(self) -> bool:
        return process_state(self.proc.pid) in ("T", "t")

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def start_worker_process(spec: WorkerSpec) -> LocalProcess:
    """Start `python -m roofline.worker.worker_process` with one end of a socket pair as its link."""
    proc, conn = start_child_process("roofline.worker.worker_process", encoder.encode(spec))
    return LocalProcess(spec.rank, proc, conn)


def start_child_process(module: str, first_message: bytes):
    """Start `python -m <module> --fd N` (N: the child's end of a socket pair) and send it
    first_message; returns (Popen, Connection).

    A fresh interpreter (not multiprocessing's spawn) so that the user's main module is never
    re-imported in the child and nothing is pickled; the child's end of the socket closes when it
    exits, which is how the parent notices a dead child.
    """
    from multiprocessing.connection import Connection

    ours, theirs = socket.socketpair()
    child_fd = theirs.detach()
    try:
        os.set_inheritable(child_fd, True)
        proc = subprocess.Popen([sys.executable, "-m", module, "--fd", str(child_fd)],
                                pass_fds=(child_fd,), close_fds=True)
    finally:
        os.close(child_fd)
    conn = Connection(ours.detach())
    conn.send_bytes(first_message)
    return proc, conn


def process_state(pid: int) -> str:
    """Linux process state letter (R, S, D, T = stopped, t = traced, Z ...), '' where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def describe_exit(proc: subprocess.Popen) -> str:
    code = proc.poll()
    if code is None:
        return "closed its connection"
    if code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
