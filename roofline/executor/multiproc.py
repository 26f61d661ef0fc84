"""Multi-process executor: one worker process per tensor-parallel rank.

The engine process holds no model.  It starts this node's ranks (node 0; other nodes run
`roofline worker`), sends every SchedulerOutput to rank 0 as msgpack bytes over a local socket, and
rank 0 broadcasts the same bytes to the other ranks over a gloo control group.  Every rank runs its
shard (the model's all-reduces and all-gathers keep them in lock step) and samples; rank 0 returns
the sampled tokens.

Faults: every receive is bounded, and the engine watches all of its ranks: a rank that dies or fails
turns the executor dead at once — execute() and check_health() raise a RuntimeError naming the rank
and its error, and the other ranks are stopped.  A rank that fails at start-up fails the launch with
that rank's error.  Hung or stopped ranks: every rank sends a heartbeat every 0.5 s from a thread of
its own; one silent for ROOFLINE_HEARTBEAT_TIMEOUT (5 s), or in the stopped state, fails the executor
the same way, mid-step or idle (check_health reads the heartbeats).  A step also has a deadline that
follows the steps seen so far (10x the slowest recent one, at least 30 s; ROOFLINE_EXECUTE_TIMEOUT caps
it), for a rank on another node that hangs without its node noticing.

Pipeline parallelism: up to max_batches_in_flight (pipeline_parallel_size) steps are out at once:
submit() sends a step without waiting, collect() takes the oldest step's output (the last stage
returns it through rank 0).  execute() is submit() then collect().
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from typing import Any, Optional

from roofline.config import EngineConfig, env_flag, parse_partition
from roofline.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from roofline.distributed.launch import LocalRanks, RankFailure, RankGroup, node_layout, startup_timeout_s
from roofline.distributed.protocol import (
    DEFAULT_WORKER_CLS,
    Call,
    Execute,
    Output,
    Result,
    Shutdown,
    encode_bootstrap,
    encoder,
)
from roofline.executor.base import Executor, ExecutorDeadError
from roofline.model_executor.loader.source import ModelSource

logger = logging.getLogger(__name__)


class WorkerDeadError(ExecutorDeadError):
    """A tensor-parallel rank died, hung or failed; the engine cannot continue."""


def execute_timeout_s() -> float:
    return float(env_flag("ROOFLINE_EXECUTE_TIMEOUT", "600"))


STEP_DEADLINE_FLOOR_S = 30.0
STEP_DEADLINE_FACTOR = 10.0
WARMUP_STEPS = 3  # the first steps may compile kernels or capture graphs: only the cap applies


def check_tensor_parallel_split(config: EngineConfig) -> None:
    """Build the model on the meta device as the first and last rank, before any process starts:
    a split the layers refuse (heads not divisible, ...) fails at once with the layers' own message."""
    import torch

    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.distributed.layout import ParallelLayout
    from roofline.distributed.parallel_state import parallel_layout_as
    from roofline.model_executor.models.registry import resolve_architecture

    hf_config = config.model_config.hf_config
    tp = config.parallel_config.tensor_parallel_size
    layout = ParallelLayout.from_config(config.parallel_config)
    from roofline.distributed import pipeline

    pc = config.parallel_config
    pipeline.set_partition(parse_partition(pc.pp_layer_partition, pc.pipeline_parallel_size))
    if hf_config is None:
        return
    arch, cls = resolve_architecture(hf_config)
    for rank in sorted({0, layout.world_size - 1}):
        try:
            with parallel_layout_as(layout, rank), torch.device("meta"):
                cls(hf_config, TorchAttentionBackend())
        except ValueError as e:
            what = f"tensor_parallel_size={tp}" if layout.world_size == tp else layout.describe()
            raise ValueError(f"{what} cannot split {arch}: {e}") from None
        except Exception:  # not a split problem; the ranks will report whatever it is
            logger.debug("meta-device build of %s failed", arch, exc_info=True)
            return


def _stop(ranks: RankGroup, graceful: bool) -> None:
    if graceful:
        try:
            ranks.by_rank(0).conn.send_bytes(encoder.encode(Shutdown()))
        except Exception:
            graceful = False
    ranks.kill(grace=10.0 if graceful else 0.0)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, show_progress: bool = True,
                 worker_cls: str = DEFAULT_WORKER_CLS) -> None:
        pc = config.parallel_config
        check_tensor_parallel_split(config)
        self.world_size = pc.world_size
        self._dead: Optional[str] = None
        self._closed = False
        self._lock = threading.Lock()  # one message exchange with the ranks at a time
        self._step_times: deque[float] = deque(maxlen=64)
        self._submitted: deque[float] = deque()  # time.monotonic() of each step not yet collected
        self.max_batches_in_flight = pc.pipeline_parallel_size
        self.ranks = self._start_ranks(config, encode_bootstrap(config), show_progress, worker_cls)
        # never leave orphans, even without shutdown()
        self._finalizer = weakref.finalize(self, _stop, self.ranks, False)
        try:
            infos = self.ranks.wait_ready(startup_timeout_s())
        except RankFailure as e:
            self._finalizer()
            raise RuntimeError(f"tensor-parallel start-up failed: {e}") from None
        except BaseException:
            self._finalizer()
            raise
        logger.debug("ranks ready: %s", infos)
        self.driver = self.ranks.by_rank(0)

    def _start_ranks(self, config: EngineConfig, bootstrap: bytes, show_progress: bool,
                     worker_cls: str) -> RankGroup:
        """Start every rank of the world (or, multi-node, this node's: the others run `roofline worker`)."""
        pc = config.parallel_config
        if pc.node_rank != 0:
            raise ValueError(
                f"the engine runs on node 0; on node {pc.node_rank} run `roofline worker --node-rank "
                f"{pc.node_rank}` with the same --nnodes/--master-addr/--master-port/-tp flags"
            )
        layout = node_layout(pc, config.device_config.device)
        logger.info("starting %d tensor-parallel ranks on %d node(s) (%s), rendezvous at %s",
                    layout.world_size, layout.nnodes, layout.backend, layout.init_method)
        return LocalRanks(layout, bootstrap=bootstrap, show_progress=show_progress, worker_cls=worker_cls)

    # ---- plumbing ------------------------------------------------------------------------------
    def _fail(self, message: str, in_background: bool = False) -> WorkerDeadError:
        """Mark the executor dead and stop the surviving ranks (they may be stuck in a collective).

        in_background: stop them from a thread — for callers that must do no socket I/O because
        another thread may be inside execute().
        """
        if self._dead is None:
            self._dead = message
            logger.error("tensor-parallel executor failed: %s", message)
            if in_background:
                threading.Thread(target=self._finalizer, daemon=True).start()
            else:
                self._finalizer()
        return WorkerDeadError(self._dead)

    def _ensure_usable(self, in_background: bool = False) -> None:
        if self._dead is not None:
            raise WorkerDeadError(self._dead)
        if self._closed:
            raise ExecutorDeadError("the executor was shut down")
        problem = self.ranks.dead()
        if problem:
            raise self._fail(problem, in_background)

    def _request(self, msg, timeout: Optional[float]) -> Any:
        with self._lock:
            self._ensure_usable()
            try:
                self.driver.conn.send_bytes(encoder.encode(msg))
                reply = self.ranks.recv(0, timeout)
            except RankFailure as e:
                raise self._fail(str(e)) from None
            except OSError as e:  # rank 0's socket is gone
                raise self._fail(self.ranks.dead() or f"lost the connection to tensor-parallel rank 0: {e}") from None
            except KeyboardInterrupt:
                # the ranks ignore SIGINT and finish the step: collect its reply so the world stays
                # consistent, then let the interrupt through
                try:
                    self.ranks.recv(0, 30.0)
                except BaseException:
                    self._fail("interrupted while the tensor-parallel ranks were running a request")
                raise
            return reply

    def _call(self, method: str, *args, timeout: Optional[float] = None) -> Any:
        if self._submitted:
            raise RuntimeError(f"{method}: {len(self._submitted)} step(s) still in flight; collect them first")
        reply = self._request(Call(method, list(args)), timeout if timeout is not None else execute_timeout_s())
        if not isinstance(reply, Result):
            raise self._fail(f"unexpected reply {type(reply).__name__} from rank 0 to {method}")
        return reply.value

    # ---- Executor --------------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        # the minimum over all ranks: every rank holds the same block table
        return int(self._call("determine_num_blocks", timeout=startup_timeout_s()))

    def block_bytes(self) -> int:
        """Bytes of one block on one rank (each rank holds only its KV heads)."""
        return int(self._call("block_bytes"))

    def weight_bytes(self) -> dict[str, int]:
        return dict(self._call("weight_bytes"))

    def init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        self._call("init_kv_cache", num_blocks, num_swap_blocks, timeout=startup_timeout_s())

    def kv_group_windows(self) -> list[int]:
        """Rank 0's (every rank plans the same layout from the same layers)."""
        return [int(w) for w in self._call("kv_group_windows", timeout=startup_timeout_s())]

    def kv_state_slots(self) -> int:
        return int(self._call("kv_state_slots", timeout=startup_timeout_s()))

    def step_deadline_s(self) -> float:
        """How long the next step may take before the executor is declared hung."""
        cap = execute_timeout_s()
        if len(self._step_times) < WARMUP_STEPS:
            return cap
        return min(cap, max(STEP_DEADLINE_FLOOR_S, STEP_DEADLINE_FACTOR * max(self._step_times)))

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(out)
        return self.collect()

    def submit(self, out: SchedulerOutput) -> None:
        with self._lock:
            self._ensure_usable()
            try:
                self.driver.conn.send_bytes(encoder.encode(Execute(out.for_workers())))
            except OSError as e:  # rank 0's socket is gone
                raise self._fail(self.ranks.dead() or f"lost the connection to rank 0: {e}") from None
            self._submitted.append(time.monotonic())

    def collect(self) -> ModelRunnerOutput:
        """The output of the oldest step submitted and not yet collected."""
        with self._lock:
            self._ensure_usable()
            if not self._submitted:
                raise RuntimeError("collect() with no step in flight")
            # the oldest step may have queued behind the others in the pipeline: its deadline counts from its submission
            deadline = self.step_deadline_s() * len(self._submitted)
            try:
                reply = self.ranks.recv(0, max(deadline - (time.monotonic() - self._submitted[0]), 1.0))
            except RankFailure as e:
                raise self._fail(str(e)) from None
            except KeyboardInterrupt:
                # the ranks ignore SIGINT and finish their steps: collect this one so the world stays
                # consistent, then let the interrupt through
                try:
                    self.ranks.recv(0, 30.0)
                    self._submitted.popleft()
                except BaseException:
                    self._fail("interrupted while the ranks were running a step")
                raise
            self._step_times.append((time.monotonic() - self._submitted.popleft()) / (len(self._submitted) + 1))
        if not isinstance(reply, Output):
            raise self._fail(f"unexpected reply {type(reply).__name__} from rank 0 to execute")
        return reply.out

    def check_health(self) -> None:
        self._ensure_usable(in_background=True)
        if not self._submitted and self._lock.acquire(blocking=False):  # no step in flight: read the heartbeats
            try:
                self.ranks.poll()
            except RankFailure as e:
                raise self._fail(str(e), in_background=True) from None
            finally:
                self._lock.release()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._finalizer.alive:
            self._finalizer.detach()
            _stop(self.ranks, graceful=self._dead is None)

    # ---- introspection (tests, tools) ------------------------------------------------------------
    def collective_counts(self) -> list[list[int]]:
        """[[all_reduces, all_gathers] per rank] issued by the model since the last reset."""
        return self._call("collective_counts")

    def reset_collective_counts(self) -> None:
        self._call("reset_collective_counts")

    def stage_busy(self) -> list[list[int]]:
        """[[busy_us, wall_us] per rank] since the last reset (pipeline bubble = 1 - busy / wall)."""
        return self._call("stage_busy")

    def reset_stage_busy(self) -> None:
        self._call("reset_stage_busy")
    def expert_placements(self) -> list[list[list[int]]]:
        """Per rank, per expert-parallel MoE layer: the logical expert each local slot holds."""
        return self._call("expert_placements")

    def rank_info(self) -> list[list[Any]]:
        """[[rank, host, pid] per rank], all nodes."""
        return self._call("rank_info")
