"""P2pConnector: engine to engine over TCP.  The decode engine pulls a prompt's KV blocks straight
from the prefill engine's pool, layer by layer, while it keeps computing its other requests.

Producer (prefill engine, kv_role kv_producer): a request with kv_transfer_params.do_remote_decode
finishes its prefill; its blocks stay held (not freed) and the worker serves them on kv_ip:kv_port
until a consumer has pulled them, or until send_timeout_s (kv_connector_extra_config; default 120 s)
passes.  The answer's kv_transfer_params name this engine, the request and its block ids.
Consumer (decode engine, kv_role kv_consumer): the request arrives with those kv_transfer_params;
after its own prefix-cache hits, the blocks it still lacks are allocated and a background thread
pulls them from the producer, writing each layer into the pool as it arrives.  The request computes
its last prompt token once the pull is done.  If every block was found locally, the consumer only
tells the producer to release them.

Wire format (no pickle): each message is a 4-byte big-endian length and a msgpack header (msgspec);
a layer's header is followed by its tensor [num_slots, n, block_size, heads, head_size], the layer's KV
cache spec (MLA's latent included), as the producer's pool holds them.
    consumer -> producer   Pull(request_id, block_ids, release_only, store_port)
    producer -> consumer   PullReply(ok, error, num_layers) then, per layer, LayerHeader(layer, nbytes) + tensor
The tensors travel by kv_connector_extra_config transport: "tcp" (default), raw bytes on the same socket;
or "torch", a two-rank torch.distributed process group per pull (gloo for CPU pools, NCCL for CUDA pools,
GPU to GPU), rendezvous through a TCPStore the consumer opens and names in Pull.store_port; the control
messages stay on the socket either way.
The pull is paced (kv_connector_extra_config max_pull_share, default 0.25): it uses at most that share
of its wall time in CPU, sleeping between layers, so that on a core the pull shares with the decode
engine's steps it stretches many steps a little instead of one step a lot (W8 on the 2-core machine: an
unpaced 128 MB pull stretched one decode step of 16 requests by ~65 ms).  1.0 pulls flat out.
Socket operations time out after transfer_timeout_s (default 30 s): a producer that died or hangs
ends in a failed load, which the consumer recomputes or fails (kv_load_failure_policy).  Held blocks
are freed as soon as their consumer is known gone: its pull connection broke mid-transfer (the producer
sees it), or no decode engine took the request (the router tells the producer, release_held_kv);
otherwise at send_timeout_s.
This implementation moves CPU tensors over TCP; a CUDA pool is staged through host memory.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any, Optional, Sequence

import msgspec

from roofline.config import KVTransferConfig
from roofline.core.kv_connector import KVConnectorScheduler, KVConnectorWorker, KVTransferParams
from roofline.core.kv_connector_messages import BlockLoad, KVConnectorMetadata, KVConnectorOutput, RemoteSource
from roofline.core.request import Request

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_TIMEOUT_S = 30.0
DEFAULT_MAX_PULL_SHARE = 0.25
TRANSPORTS = ("tcp", "torch")
REGISTER_WAIT_S = 10.0  # a pull may arrive before the producer's next step registers the request
MAX_HEADER_BYTES = 1 << 20


class Pull(msgspec.Struct, array_like=True):
    request_id: str
    block_ids: list[int]
    release_only: bool = False
    store_port: int = 0  # transport "torch": the consumer's TCPStore for the pair's process group; 0: tcp


class PullReply(msgspec.Struct, array_like=True):
    ok: bool
    error: str = ""
    num_layers: int = 0


class LayerHeader(msgspec.Struct, array_like=True):
    layer: int
    nbytes: int


_enc = msgspec.msgpack.Encoder()


def send_msg(sock: socket.socket, msg: Any, payload: Optional[memoryview] = None) -> None:
    data = _enc.encode(msg)
    sock.sendall(struct.pack(">I", len(data)) + data)
    if payload is not None:
        sock.sendall(payload)


def recv_exact(sock: socket.socket, n: int, into: Optional[memoryview] = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def recv_msg(sock: socket.socket, kind: type) -> Any:
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    if n > MAX_HEADER_BYTES:
        raise ConnectionError(f"message header of {n} bytes is too large")
    return msgspec.msgpack.decode(recv_exact(sock, n), type=kind)


class PullPacer:
    """How long a pull rests after a piece of work so that its CPU use stays at most `share` of its wall
    time: w seconds of work are followed by w * (1 / share - 1) seconds of sleep (none at share 1)."""

    def __init__(self, share: float) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.max_pull_share must be in (0, 1], "
                             f"got {share!r}")
        self.share = share

    def rest_after(self, work_s: float) -> float:
        return max(work_s, 0.0) * (1.0 / self.share - 1.0)


def max_pull_share(config: KVTransferConfig) -> float:
    value = config.extra("max_pull_share", DEFAULT_MAX_PULL_SHARE)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("kv_transfer_config.kv_connector_extra_config.max_pull_share must be a number in (0, 1], "
                         f"got {value!r}")
    return float(value)


def transport(config: KVTransferConfig) -> str:
    value = config.extra("transport", "tcp")
    if value not in TRANSPORTS:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.transport must be one of "
                         f"{', '.join(TRANSPORTS)}, got {value!r}")
    return value


class PairGroup:
    """A two-rank torch.distributed process group between a producer (rank 0) and a consumer (rank 1) for
    one pull: gloo for CPU pools, NCCL for CUDA ones.  The consumer opens the TCPStore (open_store), the
    producer joins it at the consumer's address."""

    def __init__(self, store: Any, rank: int, device: Any, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        if getattr(device, "type", "cpu") == "cuda":
            self.pg = dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options())
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
        self.store = store

    @staticmethod
    def open_store(timeout_s: float) -> Any:
        import datetime

        from torch.distributed import TCPStore

        return TCPStore("0.0.0.0", 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)

    @staticmethod
    def join_store(host: str, port: int, timeout_s: float) -> Any:
        import datetime

        from torch.distributed import TCPStore

        return TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=timeout_s))

    def send(self, tensor: Any, tag: int) -> None:
        self.pg.send([tensor], 1, tag).wait()

    def recv(self, tensor: Any, tag: int) -> None:
        self.pg.recv([tensor], 0, tag).wait()


def release_held_kv(params: dict, timeout_s: float = 5.0) -> bool:
    """Tell a P2P producer that the KV it holds for a finished prefill will never be pulled (the decode
    engine meant to take it is gone, or refused the request), so it frees the blocks now rather than at
    send_timeout_s.  params: the prefill's answer's kv_transfer_params.  False when they name no P2P
    producer, or it could not be told (it frees them at its timeout then)."""
    host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    if not (isinstance(host, str) and isinstance(port, int) and isinstance(rid, str)):
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            send_msg(sock, Pull(rid, [], release_only=True))
            return recv_msg(sock, PullReply).ok
    except (OSError, msgspec.DecodeError, ConnectionError) as e:
        logger.info("releasing the KV of %s at %s:%d failed: %s", rid, host, port, e)
        return False


class P2pScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int) -> None:
        super().__init__(config, block_size)
        if config.is_producer and config.kv_port == 0:
            raise ValueError("P2pConnector: a producer needs a fixed kv_transfer_config.kv_port "
                             "(the decoders are told where to pull from)")
        PullPacer(max_pull_share(config))  # bad settings fail at start-up, before any request
        transport(config)

    def validate_request(self, params: KVTransferParams) -> None:
        super().validate_request(params)
        if params.do_remote_prefill:
            missing = [k for k in ("remote_host", "remote_port", "remote_request_id")
                       if getattr(params, k) is None]
            if missing:
                raise ValueError(f"kv_transfer_params.{missing[0]} is needed to pull KV from a P2P producer")

    def _source(self, p: KVTransferParams, block_ids: list[int]) -> RemoteSource:
        return RemoteSource(p.remote_host or "", int(p.remote_port or 0), p.remote_request_id or "", block_ids)

    def get_num_new_matched_tokens(self, request: Request, block_hashes: Sequence[bytes],
                                   num_computed_tokens: int) -> int:
        p = request.kv_transfer
        if p is None or not p.do_remote_prefill:
            return 0
        # every prompt token but the last, the last block partial: the engine then computes one token
        # itself, not up to a block of them against the whole context (W8: 16 tokens against 2047
        # cost one decode step of 16 requests ~75 ms more)
        num_remote = min(len(p.remote_block_ids) * self.block_size, request.num_prompt_tokens - 1)
        num_ext = num_remote - num_computed_tokens
        if num_ext <= 0:  # all here already: the producer may let its copy go
            self._meta.releases.append(self._source(p, []))
            p.do_remote_prefill = False
            return 0
        return num_ext

    def update_state_after_alloc(self, request: Request, block_ids: list[int], block_hashes: Sequence[bytes],
                                 first_block: int) -> None:
        p = request.kv_transfer
        remote = p.remote_block_ids[first_block:first_block + len(block_ids)]
        self._meta.loads.append(BlockLoad(request.request_id, list(block_ids), [h.hex() for h in block_hashes],
                                          self._source(p, remote)))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        # the blocks of every prompt token but the last (the last one partial): what a consumer loads
        blocks = block_ids[:-(-(request.num_prompt_tokens - 1) // self.block_size)]
        if not blocks:  # a one-token prompt: nothing to send
            return False, {"do_remote_decode": False, "do_remote_prefill": False}
        self._meta.sends[request.request_id] = blocks
        return True, {"do_remote_decode": False, "do_remote_prefill": True,
                      "remote_engine_id": self.config.engine_id, "remote_request_id": request.request_id,
                      "remote_block_ids": blocks, "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port}


class P2pWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_caches: list[Any], block_size: int) -> None:
        super().__init__(config, kv_caches, block_size)
        self.timeout = float(config.extra("transfer_timeout_s", DEFAULT_TRANSFER_TIMEOUT_S))
        self.pacer = PullPacer(max_pull_share(config))
        self.transport = transport(config)
        self._lock = threading.Lock()  # guards the state below and every read of a held block
        self._registered = threading.Condition(self._lock)
        self._sends: dict[str, list[int]] = {}  # request id -> held block ids the producer serves
        self._out = KVConnectorOutput()
        self._closing = False
        self._server: Optional[socket.socket] = None
        if config.is_producer:
            self._server = socket.create_server((config.kv_ip, config.kv_port), reuse_port=False)
            self._server.settimeout(0.5)
            threading.Thread(target=self._serve, name="roofline-kv-p2p-server", daemon=True).start()
            logger.info("P2P KV producer serving blocks on %s:%d", config.kv_ip, config.kv_port)

    # ---- the step's plan ---------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        with self._lock:
            for rid, block_ids in meta.sends.items():
                self._sends[rid] = block_ids
            for rid in meta.cancelled_sends:  # its blocks are freed this step: never read them again
                self._sends.pop(rid, None)
            self._registered.notify_all()
        for load in meta.loads:
            threading.Thread(target=self._pull, args=(load,), name="roofline-kv-p2p-pull", daemon=True).start()
        for src in meta.releases:
            threading.Thread(target=self._release, args=(src,), name="roofline-kv-p2p-release", daemon=True).start()

    def get_finished(self) -> Optional[KVConnectorOutput]:
        with self._lock:
            out, self._out = self._out, KVConnectorOutput()
        return None if out.is_empty() else out

    # ---- consumer --------------------------------------------------------------------------------
    def _connect(self, src: RemoteSource) -> socket.socket:
        sock = socket.create_connection((src.host, src.port), timeout=self.timeout)
        sock.settimeout(self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _pull(self, load: BlockLoad) -> None:
        import torch

        src = load.remote
        nbytes = 0
        try:
            store = PairGroup.open_store(self.timeout) if self.transport == "torch" else None
            with self._connect(src) as sock:
                send_msg(sock, Pull(src.request_id, src.block_ids, store_port=store.port if store else 0))
                reply = recv_msg(sock, PullReply)
                if not reply.ok:
                    raise RuntimeError(f"the producer refused: {reply.error}")
                if reply.num_layers != len(self.kv_caches):
                    raise RuntimeError(f"the producer has {reply.num_layers} layers, this engine {len(self.kv_caches)}")
                group = PairGroup(store, 1, self.kv_caches[0].device, self.timeout) if store is not None else None
                dst_ids = torch.tensor(load.block_ids, dtype=torch.long)
                staging: Optional[torch.Tensor] = None
                for _ in range(reply.num_layers):  # each layer lands in the pool as soon as it is here
                    work_start = time.thread_time()  # this thread's CPU: the receive and the copy
                    head = recv_msg(sock, LayerHeader)
                    cache = self.kv_caches[head.layer]
                    shape = (cache.shape[0], len(load.block_ids)) + tuple(cache.shape[2:])
                    expected = cache.element_size() * int(torch.Size(shape).numel())
                    if head.nbytes != expected:
                        raise RuntimeError(f"layer {head.layer}: got {head.nbytes} bytes, this engine's KV cache "
                                           f"spec needs {expected}")
                    if group is not None:  # straight into a buffer on the pool's device (NCCL: GPU to GPU)
                        data = torch.empty(shape, dtype=cache.dtype, device=cache.device)
                        group.recv(data, head.layer)
                    else:
                        if staging is None or staging.numel() != head.nbytes:
                            staging = torch.empty(head.nbytes, dtype=torch.uint8)
                        recv_exact(sock, head.nbytes, memoryview(staging.numpy()))
                        data = staging.view(cache.dtype).view(shape)
                    cache.index_copy_(1, dst_ids.to(cache.device), data.to(cache.device))
                    nbytes += head.nbytes
                    rest = self.pacer.rest_after(time.thread_time() - work_start)
                    if rest > 0:
                        time.sleep(rest)
        except Exception as e:
            logger.warning("request %s: pulling KV from %s:%d failed: %s", load.req_id, src.host, src.port, e)
            with self._lock:
                self._out.failed_loads[load.req_id] = f"pulling KV from {src.host}:{src.port}: {type(e).__name__}: {e}"
            return
        with self._lock:
            self._out.finished_recving.append(load.req_id)
            self._out.bytes_received[load.req_id] = nbytes

    def _release(self, src: RemoteSource) -> None:
        release_held_kv({"remote_host": src.host, "remote_port": src.port, "remote_request_id": src.request_id},
                        self.timeout)  # on failure the producer frees them at its timeout anyway

    # ---- producer --------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            # Nagle off: each layer goes as a header then its bytes; with Nagle on, a write could wait for
            # the consumer's delayed ACK (up to 40 ms) of the one before
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handle, args=(conn,), name="roofline-kv-p2p-send", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        import torch

        rid = None
        serving = False  # a consumer is pulling rid's held blocks on this connection
        try:
            with conn:
                conn.settimeout(self.timeout)
                pull = recv_msg(conn, Pull)
                rid = pull.request_id
                with self._lock:
                    deadline = time.monotonic() + REGISTER_WAIT_S
                    while rid not in self._sends and time.monotonic() < deadline and not self._closing:
                        self._registered.wait(0.05)
                    held = self._sends.get(rid)
                    if held is not None and pull.release_only:
                        del self._sends[rid]
                        self._out.finished_sending.append(rid)
                if held is None:
                    send_msg(conn, PullReply(False, f"request {rid!r} holds no KV here (never, or no longer: "
                                                    "taken, or its send timeout passed)"))
                    return
                if pull.release_only:
                    send_msg(conn, PullReply(True))
                    return
                if not set(pull.block_ids) <= set(held):
                    send_msg(conn, PullReply(False, f"blocks {sorted(set(pull.block_ids) - set(held))[:8]} are not "
                                                    f"held for request {rid!r}"))
                    return
                serving = True
                send_msg(conn, PullReply(True, num_layers=len(self.kv_caches)))
                group = None
                if pull.store_port:  # transport "torch": the consumer's store, at the consumer's address
                    store = PairGroup.join_store(conn.getpeername()[0], pull.store_port, self.timeout)
                    group = PairGroup(store, 0, self.kv_caches[0].device, self.timeout)
                ids = torch.tensor(pull.block_ids, dtype=torch.long)
                sent = 0
                for i, cache in enumerate(self.kv_caches):
                    with self._lock:  # a cancelled (timed-out) send's blocks may be reused: stop reading
                        if rid not in self._sends:
                            raise ConnectionError(f"request {rid!r}: send cancelled (timed out)")
                        data = cache.index_select(1, ids.to(cache.device))
                    nbytes = data.numel() * data.element_size()
                    if group is not None:
                        send_msg(conn, LayerHeader(i, nbytes))
                        group.send(data.contiguous(), i)
                    else:
                        raw = data.cpu().contiguous().view(torch.uint8).numpy()
                        send_msg(conn, LayerHeader(i, nbytes), memoryview(raw).cast("B"))
                    sent += nbytes
                with self._lock:
                    if self._sends.pop(rid, None) is not None:
                        self._out.finished_sending.append(rid)
                    self._out.bytes_sent += sent
        except Exception as e:
            logger.warning("serving KV of %s failed: %s", rid, e)
            if serving:  # the consumer's connection broke (it died, or gave up): it never pulls these again
                with self._lock:
                    if self._sends.pop(rid, None) is not None:
                        logger.warning("request %s: its consumer went away mid-pull; its held blocks are freed", rid)
                        self._out.finished_sending.append(rid)

    def shutdown(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
