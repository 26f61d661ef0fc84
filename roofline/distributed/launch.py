"""Starting and watching this node's ranks; torchrun-style multi-node layout.

World = data_parallel_size x pipeline_parallel_size x tensor_parallel_size ranks (layout.py) over
`nnodes` nodes, world/nnodes ranks per node; node k holds global ranks [k*world/nnodes, (k+1)*world/nnodes) and node 0's rank 0 hosts the rendezvous store at
master_addr:master_port.  Node 0 runs the engine (`roofline serve`, `LLM(...)`): its executor starts
node 0's ranks.  Every other node runs `roofline worker --node-rank K` (run_worker_node below),
which starts that node's ranks and waits for them; they take their configuration from rank 0.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Optional

from roofline.config import EngineArgs, ParallelConfig, env_flag
from roofline.distributed.layout import ParallelLayout
from roofline.distributed.protocol import (
    DEFAULT_WORKER_CLS,
    HEARTBEAT_INTERVAL_S,
    Failure,
    Heartbeat,
    LocalProcess,
    RankHandle,
    Ready,
    WorkerSpec,
    describe_exit,
    reply_decoder,
    start_worker_process,
)

logger = logging.getLogger(__name__)

DEFAULT_MULTINODE_PORT = 29500  # as torchrun


def dist_timeout_s() -> float:
    """Model-collective and rendezvous timeout (a dead peer is noticed at once regardless)."""
    return float(env_flag("ROOFLINE_DIST_TIMEOUT", "600"))


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@dataclass
class NodeLayout:
    world_size: int
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    backend: str
    device: str  # cpu | cuda
    secret: str  # shared by every rank of the launch; joining the world needs it

    @property
    def ranks(self) -> range:
        return range(self.node_rank * self.nproc_per_node, (self.node_rank + 1) * self.nproc_per_node)

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"


def node_layout(pc: ParallelConfig, device: str) -> NodeLayout:
    world, nnodes, node_rank = ParallelLayout.from_config(pc).world_size, pc.nnodes, pc.node_rank
    if nnodes < 1:
        raise ValueError(f"nnodes must be >= 1, got {nnodes}")
    if world % nnodes:
        what = ("tensor_parallel_size" if world == pc.tensor_parallel_size
                else "data_parallel_size x pipeline_parallel_size x tensor_parallel_size")
        raise ValueError(f"{what} ({world}) must be a multiple of nnodes ({nnodes}): "
                         f"each node runs {world}/nnodes ranks")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, {nnodes}), got {node_rank}")
    dev = device.split(":")[0]
    backend = pc.distributed_backend or ("nccl" if dev == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed_backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and dev != "cuda":
        raise ValueError("distributed_backend='nccl' needs device='cuda'")
    port = pc.master_port
    if port is None:
        port = DEFAULT_MULTINODE_PORT if nnodes > 1 else free_port(pc.master_addr)
    nproc = world // nnodes
    secret = env_flag("ROOFLINE_DIST_SECRET")
    if not secret:
        if nnodes > 1:
            raise ValueError("a multi-node launch needs a shared secret: set ROOFLINE_DIST_SECRET to the same value "
                             "on every node (e.g. `export ROOFLINE_DIST_SECRET=$(openssl rand -hex 16)`)")
        secret = secrets.token_hex(16)  # one node: the engine hands it to its own ranks
    if dev == "cuda":
        import torch

        have = torch.cuda.device_count()
        if have < nproc:
            raise ValueError(f"{nproc} ranks per node need {nproc} GPUs on this node, found {have}")
    return NodeLayout(world, nnodes, node_rank, nproc, pc.master_addr, port, backend, dev, secret)


def heartbeat_timeout_s() -> float:
    """A rank whose heartbeats stop for this long is hung or stopped (ROOFLINE_HEARTBEAT_TIMEOUT)."""
    return float(env_flag("ROOFLINE_HEARTBEAT_TIMEOUT", "5"))


def threads_per_rank(nproc: int, cores: Optional[int] = None) -> int:
    """CPU threads for each of nproc ranks sharing `cores` (default: this process's): ROOFLINE_WORKER_THREADS
    when set."""
    forced = env_flag("ROOFLINE_WORKER_THREADS")
    if forced:
        return max(1, int(forced))
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    return max(1, cores // nproc)


class RankFailure(RuntimeError):
    """A rank failed or died; the message says which and why."""


_PEER_LOSS = ("closed by peer", "connection reset", "broken pipe", "timed out", "timeout", "lost its connection")


def order_failures(failures: list) -> str:
    """One message from several ranks' reports: root causes first.

    A rank that raised reports its own error; a rank that was killed or stopped says nothing (its
    parent describes it); its peers then fail in the next collective with "connection closed by peer".
    So: errors that are not peer losses, then deaths and hangs, then peer losses; rank order within each.
    """

    def key(m):
        if isinstance(m, Failure):
            lost = any(k in m.message.lower() for k in _PEER_LOSS)
            return (2 if lost else 0, m.rank)
        return (1, 0)

    texts: list[str] = []
    for m in sorted(failures, key=key):
        t = m.message if isinstance(m, Failure) else str(m)
        if t not in texts:
            texts.append(t)
    return "; ".join(texts)


class RankGroup:
    """Every rank this process watches (RankHandles: local processes, or the Ray executor's actors):
    wait for readiness, receive, read heartbeats, stop."""

    def __init__(self, procs: list[RankHandle]) -> None:
        self.procs = procs
        self.last_beat: dict[int, float] = {p.rank: time.monotonic() for p in procs}  # rank -> last heartbeat
        self.heartbeat_timeout = heartbeat_timeout_s()

    def close(self) -> None:
        """After kill(): release whatever holds the ranks' places (the Ray executor's placement group)."""

    def by_rank(self, rank: int) -> RankHandle:
        for p in self.procs:
            if p.rank == rank:
                return p
        raise KeyError(rank)

    # ---- receiving -------------------------------------------------------------------------------
    def _read(self, p: LocalProcess):
        """The next message from p (None for a heartbeat, which only refreshes its time), or
        RankFailure if it died (with its last words if it left any)."""
        try:
            msg = reply_decoder.decode(p.conn.recv_bytes())
        except (EOFError, OSError):
            p.wait(5)
            raise RankFailure(f"tensor-parallel worker {p.describe()} {p.exit_status() or 'closed its connection'}") from None
        if isinstance(msg, Heartbeat):
            self.last_beat[p.rank] = time.monotonic()
            return None
        return msg

    def unresponsive(self) -> Optional[str]:
        """A description of the first local rank that is stopped or has sent no heartbeat for
        heartbeat_timeout seconds (hung), or None.  No I/O: call poll() to read heartbeats first."""
        now = time.monotonic()
        for p in self.procs:
            if p.exit_status() is not None:
                continue  # dead(): described there
            if p.stopped():
                return f"tensor-parallel worker {p.describe()} is stopped (SIGSTOP or a debugger)"
            silent = now - self.last_beat.get(p.rank, now)
            if silent > self.heartbeat_timeout:
                return (f"tensor-parallel worker {p.describe()} stopped responding: no heartbeat for {silent:.1f} s "
                        "(hung)")
        return None

    def poll(self) -> None:
        """Read whatever the ranks have sent without waiting: heartbeats refresh their times; a failure,
        a death, a hang or any unexpected message raises RankFailure."""
        while True:
            ready = wait([p.conn for p in self.procs], 0)
            if not ready:
                break
            for c in ready:
                p = next(q for q in self.procs if q.conn is c)
                try:
                    m = self._read(p)
                except RankFailure as e:
                    raise self._explain([e]) from None
                if m is not None:
                    raise self._explain([m] if isinstance(m, Failure) else [
                        RankFailure(f"unexpected {type(m).__name__} from {p.describe()} while idle")])
        problem = self.dead() or self.unresponsive()
        if problem:
            raise self._explain([RankFailure(problem)])

    def recv(self, want_rank: int, timeout: Optional[float]):
        """Wait for the next message of `want_rank`; any other rank's message or death is a failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        conns = {p.conn: p for p in self.procs}
        while True:
            left = HEARTBEAT_INTERVAL_S if deadline is None else max(0.0, min(deadline - time.monotonic(),
                                                                               HEARTBEAT_INTERVAL_S))
            ready = wait(list(conns), left)
            if not ready:
                hung = self.unresponsive()
                if hung:
                    raise self._explain([RankFailure(hung)])
                if deadline is not None and time.monotonic() >= deadline:
                    raise RankFailure(f"no reply from tensor-parallel rank {want_rank} within {timeout:.0f} s "
                                      "(every local rank is alive: a rank on another node may be hung)")
                continue
            # a failure elsewhere explains a stuck rank better than the rank's own error: read all
            msgs = []
            for c in ready:
                p = conns[c]
                try:
                    m = self._read(p)
                except RankFailure as e:
                    m = e
                if m is not None:
                    msgs.append((p, m))
            hung = self.unresponsive()
            if hung:
                raise self._explain([RankFailure(hung)] + [m for _, m in msgs if isinstance(m, (Failure, RankFailure))])
            for p, m in msgs:
                if p.rank == want_rank and not isinstance(m, (Failure, RankFailure)):
                    others = [x for q, x in msgs if q is not p]
                    if others:
                        raise self._explain(others)
                    return m
            if msgs:
                raise self._explain([m for _, m in msgs])

    def _explain(self, msgs) -> RankFailure:
        """Combine failures, waiting briefly for the other ranks' own reports (the root cause)."""
        failures = list(msgs)
        deadline = time.monotonic() + 2.0
        seen = set()
        for m in failures:
            if isinstance(m, Failure):
                seen.add(m.rank)
        pending = {p.conn: p for p in self.procs if p.rank not in seen}
        while pending and time.monotonic() < deadline:
            ready = wait(list(pending), max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for c in ready:
                p = pending.pop(c)
                try:
                    m = self._read(p)
                except RankFailure as e:
                    m = e
                if m is None:  # a heartbeat: the rank may still report
                    pending[c] = p
                    continue
                if isinstance(m, (Failure, RankFailure)):
                    failures.append(m)
        return RankFailure(order_failures(failures))

    def wait_ready(self, timeout: Optional[float]) -> list[str]:
        """Block until every local rank is ready; RankFailure with the failing rank's error otherwise."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {p.conn: p for p in self.procs}
        infos = []
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending), None if left is None else min(left, 1.0))
            if not ready:
                stopped = [p for p in pending.values() if p.stopped()]
                if stopped:
                    raise RankFailure(f"tensor-parallel worker {stopped[0].describe()} is stopped at start-up")
                if deadline is not None and time.monotonic() >= deadline:
                    raise RankFailure(f"tensor-parallel ranks {sorted(p.rank for p in pending.values())} "
                                      f"not ready within {timeout:.0f} s")
                continue
            for c in ready:
                p = pending[c]
                try:
                    m = self._read(p)
                except RankFailure as e:
                    raise self._explain([e]) from None
                if m is None:
                    continue
                if isinstance(m, Failure):
                    raise self._explain([m])
                if isinstance(m, Ready):
                    infos.append(m.info)
                    del pending[c]
        return infos

    # ---- liveness and teardown -------------------------------------------------------------------
    def dead(self) -> Optional[str]:
        """A description of the first local rank that has exited, or None (no I/O, thread-safe)."""
        for p in self.procs:
            status = p.exit_status()
            if status is not None:
                return f"tensor-parallel worker {p.describe()} {status}"
        return None

    def join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(p.wait(max(0.0, deadline - time.monotonic())) for p in self.procs)

    def kill(self, grace: float = 0.0) -> None:
        if grace > 0:
            self.join(grace)
        for p in self.procs:
            p.kill()
        for p in self.procs:
            if not p.wait(10):
                logger.warning("tensor-parallel worker %s did not exit", p.describe())
            try:
                p.conn.close()
            except Exception:
                pass
        self.close()


class LocalRanks(RankGroup):
    """The worker processes of this node: started here as child processes."""

    def __init__(self, layout: NodeLayout, *, bootstrap: Optional[bytes] = None, show_progress: bool = False,
                 worker_cls: str = DEFAULT_WORKER_CLS, model_override: Optional[str] = None) -> None:
        super().__init__([])
        self.layout = layout
        threads = threads_per_rank(layout.nproc_per_node)
        level = logging.getLogger().getEffectiveLevel()
        try:
            for local_rank, rank in enumerate(layout.ranks):
                spec = WorkerSpec(
                    rank=rank, world_size=layout.world_size, local_rank=local_rank, node_rank=layout.node_rank,
                    nnodes=layout.nnodes, master_addr=layout.master_addr, master_port=layout.master_port,
                    secret=layout.secret, backend=layout.backend,
                    device=layout.device, timeout_s=dist_timeout_s(), num_threads=threads, log_level=level,
                    show_progress=show_progress, worker_cls=worker_cls,
                    bootstrap=bootstrap if rank == 0 else None, model_override=model_override,
                )
                self.procs.append(start_worker_process(spec))
                self.last_beat[rank] = time.monotonic()
        except BaseException:
            self.kill()
            raise


def startup_timeout_s() -> float:
    return float(env_flag("ROOFLINE_WORKER_STARTUP_TIMEOUT", "3600"))


def run_worker_node(args: EngineArgs) -> int:
    """`roofline worker`: run node `args.node_rank` (>= 1) of a multi-node engine until it shuts down.

    Only the distributed flags (tensor_parallel_size, data_parallel_size, pipeline_parallel_size,
    enable_expert_parallel, nnodes, node_rank, master_addr, master_port, distributed_backend, device) and an optional local --model path are used here; everything else
    comes from node 0.
    """
    config = args.create_engine_config()
    pc = config.parallel_config
    if pc.nnodes < 2 or pc.node_rank < 1:
        raise ValueError("`roofline worker` runs the nodes with --node-rank >= 1 of an --nnodes >= 2 engine; "
                         "node 0 runs the engine itself (roofline serve / LLM)")
    layout = node_layout(pc, config.device_config.device)
    logger.info("node %d/%d: ranks %s, rendezvous at %s", pc.node_rank, pc.nnodes, list(layout.ranks),
                layout.init_method)
    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, on_sigterm)  # stop our ranks too, like Ctrl-C
    except ValueError:  # not the main thread
        pass
    ranks = LocalRanks(layout, model_override=args.model)
    try:
        ranks.wait_ready(startup_timeout_s())
        logger.info("node %d ready; serving until node 0 shuts down", pc.node_rank)
        # serve: the only thing a rank ever tells us now is that it failed
        while True:
            alive = [p for p in ranks.procs if p.proc.poll() is None]
            if not alive:
                break
            ready = wait([p.conn for p in alive], HEARTBEAT_INTERVAL_S)
            for c in ready:
                p = next(q for q in alive if q.conn is c)
                try:
                    m = ranks._read(p)
                except RankFailure:
                    continue  # exited; its return code tells below
                if isinstance(m, Failure):
                    raise RankFailure(m.message)
            hung = ranks.unresponsive()
            if hung:  # stop this node's ranks: their peers on node 0 then fail fast instead of hanging
                raise RankFailure(hung)
        bad = [p for p in ranks.procs if p.proc.returncode != 0]
        if bad:
            raise RankFailure("; ".join(f"{p.describe()} {describe_exit(p.proc)}" for p in bad))
        logger.info("node %d: all ranks finished", pc.node_rank)
        return 0
    except RankFailure as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        ranks.kill(grace=5.0)
