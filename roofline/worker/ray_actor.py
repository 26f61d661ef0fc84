"""The Ray executor's actor: one rank of the world in a Ray worker process.

The executor (executor/ray_executor.py) places one RankActor per rank in a placement group, asks each
where it runs, then calls run(): the actor connects back to the engine over TCP, proves it holds the
launch's secret (HMAC of the engine's nonce), and serves as any rank does (worker_process.serve_rank:
the same rendezvous, layout, messages and heartbeats as a rank started by the `mp` executor).

Ray is imported only inside the methods: this module is loaded by Ray's worker processes, and by the
executor, which wraps the class with ray.remote.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
from multiprocessing.connection import Connection

import msgspec

HANDSHAKE_TIMEOUT_S = 30.0


def handshake_digest(secret: str, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


class RankActor:
    """One rank.  where() and free_port() answer at once; run() serves until the world shuts down."""

    def where(self) -> dict:
        """This actor's id, its Ray node (id and IP), host name, pid, and the node's CPUs as Ray counts them."""
        import ray

        context = ray.get_runtime_context()
        node_id = context.get_node_id()
        cpus = next((n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["NodeID"] == node_id), 0.0)
        return {"actor_id": context.get_actor_id(), "node_id": node_id, "ip": ray.util.get_node_ip_address(), "host": socket.gethostname(),
                "pid": os.getpid(), "node_cpus": int(cpus)}

    def free_port(self) -> int:
        """A free TCP port on this node (rank 0 hosts the rendezvous store on it)."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def run(self, spec_bytes: bytes, engine_host: str, engine_port: int) -> int:
        """Connect to the engine and serve as the rank of spec_bytes (an encoded WorkerSpec).  Returns 0
        after the engine's Shutdown; a failure is reported to the engine and ends this process."""
        from roofline.distributed.protocol import spec_decoder
        from roofline.worker.worker_process import serve_rank

        spec = spec_decoder.decode(spec_bytes)
        sock = socket.create_connection((engine_host, engine_port), timeout=HANDSHAKE_TIMEOUT_S)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the engine's end (ray_executor.py)
        conn = Connection(sock.detach())
        if not conn.poll(HANDSHAKE_TIMEOUT_S):
            raise TimeoutError(f"the engine at {engine_host}:{engine_port} sent no handshake")
        nonce = conn.recv_bytes()
        conn.send_bytes(msgspec.msgpack.encode([spec.rank, handshake_digest(spec.secret, nonce)]))
        serve_rank(spec, conn)
        return 0
