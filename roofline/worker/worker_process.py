"""The main loop of one tensor-parallel rank (a process of its own).

Started by MultiprocExecutor (node 0) or by `roofline worker` (other nodes) as
`python -m roofline.worker.worker_process --fd N`, where N is this process's end of a socket pair
to its parent; or, under the Ray executor, inside a Ray actor (worker/ray_actor.py) whose link to the
engine is an authenticated TCP connection.  The life of a rank:

1. read its WorkerSpec from the parent; join the world (torch.distributed TCP rendezvous);
2. receive the engine configuration from rank 0 (control broadcast), load its shard of the model;
3. exchange start-up status with every rank: if any rank failed, every rank fails with that rank's
   error (so the engine reports the real cause, whichever node it happened on);
4. loop: rank 0 reads the next request from the engine and broadcasts its bytes to all ranks; every
   rank runs it (the model's collectives keep them in lock step); rank 0 sends the reply back.

Data-parallel attention: every rank gets the whole step and runs its DP rank's part; each DP rank's
first rank sends its part's output to rank 0 on a group of their own, and rank 0 returns the merge.

Pipeline parallelism (several steps in flight): rank 0 hands each engine message to every other rank
with point-to-point sends that do not wait for the receiver (parallel_state.send_without_waiting: a
broadcast or a plain gloo send waits for every receiver, so rank 0 could not take step n+1 while a later
stage still runs step n); the last
stage's first TP rank sends each step's Output to rank 0 on a group of their own, and a thread of
rank 0 forwards it to the engine as it comes.

Any error after start-up is sent to the parent as a Failure and the process exits: a tensor-parallel
world cannot continue without one of its ranks.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

import msgspec
import torch

from roofline.config import parse_partition
from roofline.core.scheduler_output import ModelRunnerOutput, merge_runner_outputs, runner_output_decoder
from roofline.distributed import comm, pipeline
from roofline.distributed.layout import ParallelLayout
from roofline.distributed.parallel_state import (
    collective_counts,
    destroy_distributed,
    init_distributed,
    init_model_parallel,
    reset_collective_counts,
)
from roofline.distributed.protocol import (
    Bootstrap,
    Call,
    Execute,
    HEARTBEAT_INTERVAL_S,
    Failure,
    Heartbeat,
    Output,
    RankStatus,
    Ready,
    Result,
    Shutdown,
    WorkerSpec,
    bootstrap_decoder,
    decode_hf_config,
    encoder,
    request_decoder,
    spec_decoder,
    status_decoder,
)

logger = logging.getLogger("roofline.worker")


class StartupFailed(RuntimeError):
    """Some rank failed before serving; the message names the rank(s) and the error."""


def _error_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _combine_errors(statuses: list[RankStatus]) -> Optional[str]:
    """One message for the whole world, ranks with the same error grouped."""
    by_error: dict[str, list[RankStatus]] = {}
    for s in statuses:
        if s.error:
            by_error.setdefault(s.error, []).append(s)
    if by_error:
        parts = []
        for err, ss in by_error.items():
            who = ", ".join(str(s.rank) for s in ss)
            hosts = sorted({s.host for s in ss})
            parts.append(f"rank{'s' if len(ss) > 1 else ''} {who} (on {', '.join(hosts)}) failed at start-up: {err}")
        return "; ".join(parts)
    return None


def _load_class(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class WorkerProc:
    def __init__(self, spec: WorkerSpec, conn) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.conn = conn
        self.worker: Any = None
        self.config = None
        self.send_lock = threading.Lock()  # the heartbeat thread shares the connection
        self.output_rank = 0
        self.output_group = None  # pipeline: rank 0 and the last stage's driver
        self.dp_drivers: list[int] = []  # data-parallel attention: each DP rank's first rank (rank 0's first)
        self.dp_output_group = None  # ... and the gloo group on which they hand their outputs to rank 0
        self.execute_s = 0.0  # time in Worker.execute since busy_since (pipeline bubble accounting)
        self.busy_since = time.perf_counter()

    # ---- start-up ------------------------------------------------------------------------------
    def startup(self) -> None:
        spec = self.spec
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(spec.local_rank)
        init_distributed(spec.rank, spec.world_size, spec.master_addr, spec.master_port, spec.secret, spec.backend,
                         spec.timeout_s)
        boot: Bootstrap = bootstrap_decoder.decode(comm.broadcast_bytes(spec.bootstrap if self.rank == 0 else None, 0))
        # the layout first: every rank must agree on it before the model groups are created collectively
        layout = self._exchange_status(self._layout, boot)
        init_model_parallel(layout)
        self.output_rank = pipeline.last_stage_driver()  # who holds a step's sampled tokens
        if self.output_rank != 0:
            self.output_group = pipeline.new_output_group(self.output_rank)  # collective: every rank
            if self.rank == 0:
                threading.Thread(target=self.forward_outputs, name="pp-outputs", daemon=True).start()
        if layout.dp > 1:  # data-parallel attention: every DP rank's sampled tokens come back through rank 0
            import torch.distributed as dist

            from roofline.distributed.parallel_state import CONTROL_TIMEOUT

            self.dp_drivers = [layout.rank_of(dp=d) for d in range(layout.dp)]
            self.dp_output_group = dist.new_group(self.dp_drivers, backend="gloo", timeout=CONTROL_TIMEOUT)
        self._exchange_status(self._build, boot)
        self._send(Ready(self.rank, f"rank {self.rank} on {socket.gethostname()} pid {os.getpid()}"))

    def _exchange_status(self, step, boot: Bootstrap):
        """Run step(boot) here, then tell every rank how it went: if it failed on any rank, every rank
        fails with that rank's error (so the engine reports the real cause, whichever node it was on)."""
        error, value = None, None
        try:
            value = step(boot)
        except Exception as e:
            logger.exception("rank %d failed to start", self.rank)
            error = _error_line(e)
        status = RankStatus(self.rank, socket.gethostname(), os.getpid(), error)
        statuses = [status_decoder.decode(b) for b in comm.all_gather_bytes(encoder.encode(status))]
        problem = _combine_errors(statuses)
        if problem:
            raise StartupFailed(problem)
        return value

    def _layout(self, boot: Bootstrap) -> ParallelLayout:
        pc = boot.config.parallel_config
        layout = ParallelLayout.from_config(pc)
        pipeline.set_partition(parse_partition(pc.pp_layer_partition, pc.pipeline_parallel_size))
        if (layout.world_size, pc.nnodes) != (self.spec.world_size, self.spec.nnodes):
            raise ValueError(
                f"node {self.spec.node_rank} was started with a world of {self.spec.world_size} ranks, "
                f"nnodes={self.spec.nnodes} but node 0 with {layout.describe()}, nnodes={pc.nnodes}"
            )
        return layout

    def _build(self, boot: Bootstrap) -> None:
        from roofline.model_executor.loader.source import resolve_source

        config = boot.config
        mc = config.model_config
        model = self.spec.model_override if self.spec.model_override is not None else boot.model
        source = resolve_source(model, mc.load_format)
        mc.model_path, mc.gguf_file = source.path, source.gguf_file
        mc.hf_config = decode_hf_config(boot.hf_config_json)
        dev = config.device_config.device
        if dev.startswith("cuda"):
            config.device_config.device = f"cuda:{self.spec.local_rank}"
        elif self.spec.device != dev.split(":")[0]:
            raise ValueError(f"node {self.spec.node_rank} uses device {self.spec.device!r} but node 0 uses {dev!r}")
        cls = _load_class(self.spec.worker_cls)
        self.config = config
        self.worker = cls(config, source, rank=self.rank, show_progress=self.spec.show_progress and self.rank == 0)

    # ---- serving -------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        data = encoder.encode(msg)
        with self.send_lock:
            self.conn.send_bytes(data)

    def heartbeat(self) -> None:
        """Tell the parent we are alive, every HEARTBEAT_INTERVAL_S, for as long as the process runs."""
        beat = Heartbeat(self.rank)
        while True:
            try:
                self._send(beat)
            except Exception:  # the parent is gone; the main loop finds out on its own
                return
            time.sleep(HEARTBEAT_INTERVAL_S)

    def forward_outputs(self) -> None:
        """Rank 0, pipeline: the last stage's Outputs to the engine, in step order, as they come."""
        while True:
            try:
                data = comm.recv_bytes(self.output_rank, self.output_group)
            except Exception:  # the last stage is gone; the engine hears of it from that rank's parent
                logger.warning("rank 0 lost the last pipeline stage's output link")
                return
            with self.send_lock:
                self.conn.send_bytes(data)

    def _next_message(self) -> bytes:
        """The engine's next message, on every rank (rank 0 reads it from the engine)."""
        data = None
        if self.rank == 0:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):  # the engine is gone: take every rank down with us
                logger.warning("rank 0 lost its engine connection; shutting down the world")
                data = encoder.encode(Shutdown())
        if self.output_rank == 0:
            return comm.broadcast_bytes(data, 0)
        if self.rank == 0:  # pipeline: sends, which do not wait for the later stages (see the module doc)
            for r in range(1, self.spec.world_size):
                comm.send_bytes(data, r)
            return data
        return comm.recv_bytes(0)

    def serve(self) -> None:
        while True:
            msg = request_decoder.decode(self._next_message())
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Execute):
                t0 = time.perf_counter()
                out = self.worker.execute(msg.out)
                self.execute_s += time.perf_counter() - t0
                if self.output_rank != 0:  # pipeline: the last stage sampled; rank 0 forwards its Output
                    if self.rank == self.output_rank:
                        comm.send_bytes(encoder.encode(Output(out)), 0, self.output_group)
                elif self.dp_drivers:
                    self._gather_data_parallel_outputs(out)
                elif self.rank == 0:
                    self._send(Output(out))
            elif isinstance(msg, Call):
                fn = getattr(self, "rpc_" + msg.method, None)
                if fn is None:
                    raise ValueError(f"unknown worker call {msg.method!r}")
                value = fn(*msg.args)
                if self.rank == 0:
                    self._send(Result(value))

    def _gather_data_parallel_outputs(self, out: ModelRunnerOutput) -> None:
        """Data-parallel attention: each DP rank's driver hands its part's output to rank 0, which sends
        the engine their merge (the step's communication statistics are rank 0's own)."""
        if self.rank == 0:
            parts = [out] + [runner_output_decoder.decode(comm.recv_bytes(r, self.dp_output_group))
                             for r in self.dp_drivers[1:]]
            merged = merge_runner_outputs(parts)
            merged.parallel = out.parallel
            self._send(Output(merged))
        elif self.rank in self.dp_drivers:
            out.parallel = None
            comm.send_bytes(encoder.encode(out), 0, self.dp_output_group)

    # ---- calls (run on every rank; rank 0's value is returned) ----------------------------------
    def rpc_determine_num_blocks(self) -> int:
        # every rank must be able to hold the pool: the smallest one decides
        return comm.all_reduce_min(int(self.worker.determine_num_blocks()))

    def rpc_block_bytes(self) -> int:
        return int(self.worker.block_bytes())

    def rpc_weight_bytes(self) -> dict[str, int]:
        return dict(self.worker.weight_bytes)

    def rpc_init_kv_cache(self, num_blocks: int, num_swap_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks, num_swap_blocks)

    def rpc_kv_group_windows(self) -> list[int]:
        return list(self.worker.kv_group_windows())

    def rpc_kv_state_slots(self) -> int:
        return int(self.worker.num_state_slots())

    def rpc_collective_counts(self) -> list[list[int]]:
        return comm.all_gather_ints(list(collective_counts()))

    def rpc_reset_collective_counts(self) -> None:
        reset_collective_counts()

    def rpc_stage_busy(self) -> list[list[int]]:
        """[[busy_us, wall_us] per rank] since the last reset: busy = executing steps, less the time spent
        waiting for the previous pipeline stage (1 - busy / wall is the rank's bubble)."""
        runner = self.worker.runner
        busy = self.execute_s - (runner.stage_wait_s if runner is not None else 0.0)
        wall = time.perf_counter() - self.busy_since
        return comm.all_gather_ints([int(busy * 1e6), int(wall * 1e6)])

    def rpc_reset_stage_busy(self) -> None:
        self.execute_s = 0.0
        if self.worker.runner is not None:
            self.worker.runner.stage_wait_s = 0.0
        self.busy_since = time.perf_counter()
    def rpc_expert_placements(self) -> list[list[list[int]]]:
        """Per rank, per expert-parallel MoE layer: the logical expert of each of its local slots."""
        from roofline.model_executor.layers.moe import FusedMoE

        mine = [list(m.expert_map.local_logical) for m in self.worker.model.modules()
                if isinstance(m, FusedMoE) and m.expert_map is not None]
        return [msgspec.msgpack.decode(b) for b in comm.all_gather_bytes(msgspec.msgpack.encode(mine))]

    def rpc_rank_info(self) -> list[list[Any]]:
        info = msgspec.msgpack.encode([self.rank, socket.gethostname(), os.getpid()])
        return [msgspec.msgpack.decode(b) for b in comm.all_gather_bytes(info)]


def _exit_when_parent_goes(conn, served: threading.Event) -> None:
    """Ranks other than 0 never hear from their parent after the spec: EOF means it is gone (unless the
    rank has already served to the end: a Ray actor outlives its rank loop)."""
    try:
        while True:
            conn.recv_bytes()
    except Exception:
        pass
    if served.is_set():
        return
    logger.error("lost the connection to the parent process; exiting")
    logging.shutdown()
    os._exit(1)


def run_worker(spec: WorkerSpec, conn) -> int:
    """The whole life of a rank in a process of its own: serve, then leave without interpreter teardown."""
    serve_rank(spec, conn)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: nothing is left to clean up, and it is slow


def serve_rank(spec: WorkerSpec, conn) -> None:
    """Start, serve until the engine's Shutdown, and return.  On any failure: report it to the parent as
    a Failure and end the process at once (os._exit(1): peers may be stuck in a collective with us).
    The Ray executor's actors call this too (worker/ray_actor.py), with a TCP connection to the engine."""
    torch.set_num_threads(max(1, spec.num_threads))
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s [rank {spec.rank}] %(name)s: %(message)s")
    served = threading.Event()
    if spec.rank != 0:  # rank 0 reads its socket itself (and stops the world when the engine is gone)
        threading.Thread(target=_exit_when_parent_goes, args=(conn, served), name="parent-watch", daemon=True).start()
    proc = WorkerProc(spec, conn)
    threading.Thread(target=proc.heartbeat, name="heartbeat", daemon=True).start()
    phase = "start-up"
    try:
        proc.startup()
        phase = "serving"
        proc.serve()
    except BaseException as e:  # report, then leave at once: peers may be stuck in a collective
        if isinstance(e, StartupFailed):
            message = str(e)
        elif phase == "start-up":
            logger.exception("rank %d failed at start-up", spec.rank)
            message = f"rank {spec.rank} (on {socket.gethostname()}) failed at start-up: {_error_line(e)}"
        else:
            logger.exception("rank %d failed", spec.rank)
            err = _error_line(e)
            if "closed by peer" in err.lower() or "connection reset" in err.lower():
                err = f"lost its connection to another rank, which died or failed (see its node's log): {err}"
            message = f"rank {spec.rank} (on {socket.gethostname()}) failed: {err}"
        try:
            proc._send(Failure(spec.rank, message, phase == "start-up"))
        except Exception:
            pass
        logging.shutdown()
        os._exit(1)
    served.set()
    destroy_distributed()


def main(argv: Optional[list[str]] = None) -> int:
    from multiprocessing.connection import Connection

    parser = argparse.ArgumentParser(description="one tensor-parallel rank (started by roofline, not by hand)")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the socket to its parent")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop (Ctrl-C reaches it too)
    conn = Connection(args.fd)
    try:
        spec = spec_decoder.decode(conn.recv_bytes())
    except (EOFError, OSError, msgspec.DecodeError) as e:
        print(f"roofline worker: no valid spec from the parent: {e}", file=sys.stderr)
        return 2
    return run_worker(spec, conn)


if __name__ == "__main__":
    sys.exit(main())
