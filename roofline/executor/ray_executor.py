"""The Ray executor (`--distributed-executor-backend ray`): the ranks of the world as Ray actors.

The engine connects to the Ray cluster at RAY_ADDRESS (or starts a local Ray when none is set or
running), reserves one placement-group bundle per rank ({"CPU": 1}, plus {"GPU": 1} on CUDA) with
`--ray-placement-strategy` (PACK by default), and places one RankActor (worker/ray_actor.py) in each.
Everything after that is the `mp` executor's (MultiprocExecutor): the actors run the same rank loop
(worker_process.serve_rank), join the same torch.distributed world with the same process-group layout
(TP, PP, DP, EP), and talk to the engine with the same messages, over an authenticated TCP connection
each instead of a socket pair.

Rank order (deterministic): the bundles are sorted by (not on the engine's node, node IP, node id,
bundle index) and rank r takes the r-th; so the engine's node holds the first ranks, and each node's ranks
are consecutive, which keeps a tensor-parallel group (consecutive ranks, TP innermost) on one node
whenever the strategy packs it there.

Faults: a dead actor closes its connection and ends its Ray task (a watcher thread records how); a
node that vanishes stops the heartbeats: either fails the executor within seconds, the message naming
the rank, its actor and its node.  A placement group that cannot be satisfied is an error after
`--ray-placement-timeout` seconds, with what the cluster has.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import select
import socket
import threading
import time
from typing import Any, Optional

import msgspec

from roofline.config import EngineConfig, env_flag
from roofline.distributed.launch import RankGroup, dist_timeout_s, startup_timeout_s, threads_per_rank
from roofline.distributed.protocol import RankHandle, WorkerSpec, encoder
from roofline.executor.multiproc import MultiprocExecutor
from roofline.worker.ray_actor import HANDSHAKE_TIMEOUT_S, RankActor, handshake_digest

logger = logging.getLogger(__name__)

RAY_EXTRA_HINT = "pip install 'roofline[ray]'"


def import_ray():
    """Ray, or an error that names the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"--distributed-executor-backend ray needs Ray, which is not installed: {RAY_EXTRA_HINT} "
                           f"({e})") from None
    return ray


def rank_order(bundle_nodes: dict[int, str], node_ips: dict[str, str], engine_node: str) -> list[int]:
    """Bundle indices in rank order (see the module docstring)."""
    return sorted(bundle_nodes, key=lambda b: (bundle_nodes[b] != engine_node, node_ips.get(bundle_nodes[b], ""),
                                               bundle_nodes[b], b))


class RayRank(RankHandle):
    """One rank's actor: its TCP connection to the engine and the Ray task that runs it."""

    def __init__(self, rank: int, actor: Any, where: dict) -> None:
        self.rank = rank
        self.actor = actor
        self.where = where
        self.conn: Any = None
        self.run_ref: Any = None
        self.ended = threading.Event()
        self.status: Optional[str] = None  # how the actor's run ended (set once, by the watcher)

    def describe(self) -> str:
        w = self.where
        return (f"rank {self.rank} (Ray actor {w['actor_id'][:12]}, pid {w['pid']}, "
                f"on node {w['ip']} {w['node_id'][:12]})")

    def exit_status(self) -> Optional[str]:
        return self.status if self.ended.is_set() else None

    def wait(self, timeout: float) -> bool:
        return self.run_ref is None or self.ended.wait(timeout)

    def kill(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone, or Ray is down
            pass

    def finished(self, ray, ref) -> None:
        """Record how the run task ended (the watcher calls this once its ref is ready)."""
        try:
            code = ray.get(ref, timeout=0)
            self.status = f"exited with code {code}"
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self.status = f"died ({type(e).__name__}: {first})"
        self.ended.set()


class RayRanks(RankGroup):
    """Every rank of the world as a Ray actor in one placement group."""

    def __init__(self, config: EngineConfig, bootstrap: bytes, show_progress: bool, worker_cls: str) -> None:
        super().__init__([])
        ray = import_ray()
        self.ray = ray
        pc = config.parallel_config
        self.pg = None
        self.owns_ray = False
        self._stop_watch = threading.Event()
        self._server: Optional[socket.socket] = None
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            logger.info("connecting to Ray at %s", address or "a new local Ray instance")
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
            self.owns_ray = True
        try:
            self._start(config, pc, bootstrap, show_progress, worker_cls)
        except BaseException:
            self.kill()
            raise

    # ---- start-up ------------------------------------------------------------------------------
    def _start(self, config: EngineConfig, pc, bootstrap: bytes, show_progress: bool, worker_cls: str) -> None:
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        world = pc.world_size
        device = config.device_config.device.split(":")[0]
        bundle = {"CPU": 1.0, "GPU": 1.0} if device == "cuda" else {"CPU": 1.0}
        self.pg = placement_group([dict(bundle) for _ in range(world)], strategy=pc.ray_placement_strategy)
        timeout = pc.ray_placement_timeout
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {world} rank(s) of {bundle} each with strategy {pc.ray_placement_strategy} "
                f"within --ray-placement-timeout {timeout:g} s: the cluster has {ray.cluster_resources()} in all, "
                f"{ray.available_resources()} free, on {sum(n['Alive'] for n in ray.nodes())} node(s)")
        bundle_nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        node_ips = {nid: n["NodeManagerAddress"] for nid, n in nodes.items()}
        engine_node = ray.get_runtime_context().get_node_id()
        order = rank_order(bundle_nodes, node_ips, engine_node)

        remote = ray.remote(RankActor)
        handles = []
        for rank, b in enumerate(order):
            actor = remote.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=b),
            ).remote()
            handles.append(actor)
        wheres = ray.get([a.where.remote() for a in handles], timeout=startup_timeout_s())
        self.procs = [RayRank(r, a, w) for r, (a, w) in enumerate(zip(handles, wheres))]
        master_addr = wheres[0]["ip"]
        master_port = ray.get(handles[0].free_port.remote(), timeout=startup_timeout_s())
        per_node: dict[str, int] = {}
        for w in wheres:
            per_node[w["node_id"]] = per_node.get(w["node_id"], 0) + 1
        secret = env_flag("ROOFLINE_DIST_SECRET") or secrets.token_hex(16)
        backend = pc.distributed_backend or ("nccl" if device == "cuda" else "gloo")
        level = logging.getLogger().getEffectiveLevel()

        host = ray.util.get_node_ip_address()
        self._server = socket.create_server((host, 0))
        port = self._server.getsockname()[1]
        logger.info("Ray placed %d rank(s) on %d node(s) (%s); rendezvous at %s:%d", world, len(per_node),
                    pc.ray_placement_strategy, master_addr, master_port)
        for p in self.procs:
            w = p.where
            threads = threads_per_rank(per_node[w["node_id"]], cores=w["node_cpus"])
            spec = WorkerSpec(
                rank=p.rank, world_size=world, local_rank=0, node_rank=0, nnodes=1, master_addr=master_addr,
                master_port=master_port, secret=secret, backend=backend, device=device, timeout_s=dist_timeout_s(),
                num_threads=threads, log_level=level, show_progress=show_progress, worker_cls=worker_cls,
                bootstrap=bootstrap if p.rank == 0 else None)
            p.run_ref = p.actor.run.remote(encoder.encode(spec), host, port)
            self.last_beat[p.rank] = time.monotonic()
        threading.Thread(target=self._watch, name="ray-ranks", daemon=True).start()
        self._accept(secret, startup_timeout_s())

    def _accept(self, secret: str, timeout: float) -> None:
        """Take every rank's connection (checking its HMAC of our nonce), failing fast if an actor ends."""
        from multiprocessing.connection import Connection

        by_rank = {p.rank: p for p in self.procs}
        deadline = time.monotonic() + timeout
        while any(p.conn is None for p in self.procs):
            dead = self.dead()
            if dead:
                raise RuntimeError(f"Ray rank start-up failed: {dead}")
            if time.monotonic() > deadline:
                missing = [p.rank for p in self.procs if p.conn is None]
                raise RuntimeError(f"Ray ranks {missing} did not connect to the engine within {timeout:.0f} s")
            if not select.select([self._server], [], [], 0.5)[0]:
                continue
            sock, _ = self._server.accept()
            sock.settimeout(None)
            # Nagle off: Connection.send_bytes writes a message over 16 KiB as its length, then its bytes;
            # with Nagle on, the second write could wait for the rank's delayed ACK (up to 40 ms a step)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock.detach())
            nonce = secrets.token_bytes(32)
            try:
                conn.send_bytes(nonce)
                if not conn.poll(HANDSHAKE_TIMEOUT_S):
                    raise ValueError("no handshake")
                rank, digest = msgspec.msgpack.decode(conn.recv_bytes(), type=tuple[int, bytes])
                if not hmac.compare_digest(digest, handshake_digest(secret, nonce)) or rank not in by_rank:
                    raise ValueError("bad handshake")
            except (ValueError, OSError, EOFError, msgspec.DecodeError) as e:
                logger.warning("refused a connection to the Ray executor's engine socket: %s", e)
                conn.close()
                continue
            by_rank[rank].conn = conn
        self._server.close()
        self._server = None

    def _watch(self) -> None:
        """Record each actor's end as it happens (exit_status() then reads it without I/O)."""
        ray = self.ray
        pending = {p.run_ref: p for p in self.procs}
        while pending and not self._stop_watch.is_set():
            try:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            except Exception:  # Ray went down: every rank is gone
                for p in pending.values():
                    p.status = "was lost (Ray shut down)"
                    p.ended.set()
                return
            for ref in ready:
                pending.pop(ref).finished(ray, ref)

    # ---- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        self._stop_watch.set()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        if self.owns_ray:
            self.owns_ray = False
            self.ray.shutdown()


class RayExecutor(MultiprocExecutor):
    """MultiprocExecutor whose ranks are Ray actors (see the module docstring)."""

    def _start_ranks(self, config: EngineConfig, bootstrap: bytes, show_progress: bool,
                     worker_cls: str) -> RankGroup:
        return RayRanks(config, bootstrap, show_progress, worker_cls)
