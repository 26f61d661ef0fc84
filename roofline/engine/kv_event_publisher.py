"""Publishes the engine's KV-cache events (core/kv_events.py) over ZMQ as vLLM does (`--kv-events-config`).

A background thread owns the sockets, so a step only encodes its batch and queues it:
  * PUB at `endpoint` (bound when it names no host -- `tcp://*:5557`, ipc://, inproc:// -- else connected):
    every batch as three frames: the topic, an 8-byte big-endian sequence number (0, 1, ...), the msgpack
    `KVEventBatch`;
  * ROUTER at `replay_endpoint` (when set): a client (REQ) sends a sequence number and gets every batch still
    buffered (the last `buffer_steps`) from it on, each as (sequence number, payload), then an end marker (-1,
    empty payload).
A full queue (a stalled thread) drops the batch and counts it (`dropped`); ZMQ drops past `hwm` per slow
subscriber.  The subscriber in vLLM's examples/online_serving/kv_events_subscriber.py reads this unchanged.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Optional

import msgspec
import zmq

from roofline.config import KVEventsConfig
from roofline.core.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.dropped = 0
        self._queue: queue.Queue[Optional[bytes]] = queue.Queue(maxsize=config.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV-cache events published at %s%s (topic %r)", config.endpoint,
                    f", replay at {config.replay_endpoint}" if config.replay_endpoint else "", config.topic)

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(self._encoder.encode(batch))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        topic = self.config.topic.encode()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._answer_replay()
            try:
                payload = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if payload is None:
                return
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((topic, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
