"""KV-cache events (--kv-events-config): what the prefix cache stores and evicts reaches a ZMQ subscriber in
vLLM's wire format -- decoded here with the structs of vLLM's own subscriber example (written out below, as
that example writes them) -- with a replay of missed batches."""

from __future__ import annotations

import socket
import time
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from roofline import LLM, SamplingParams
from roofline.config import KVEventsConfig
from roofline.core.block_pool import BlockPool
from roofline.core.kv_events import BlockRemoved, BlockStored, KVEventRecorder


# vLLM's subscriber side (examples/online_serving/kv_events_subscriber.py), block hashes as bytes or int
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(EventBatch):
    events: list[Union[VBlockStored, VBlockRemoved, VAllBlocksCleared]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_recorder_joins_one_requests_blocks_and_the_pool_reports_evictions():
    pool = BlockPool(3)
    pool.events = KVEventRecorder(block_size=2, medium="CPU")
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"h1", None, [1, 2], None)
    pool.cache_block(b, b"h2", b"h1", [3, 4], None)
    pool.cache_block(c, b"h1", None, [1, 2], None)  # already cached elsewhere: no event
    events = pool.events.drain()
    assert events == [BlockStored([b"h1", b"h2"], None, [1, 2, 3, 4], 2, None, "CPU")]
    pool.free_blocks([b, a, c])
    pool.get_new_blocks(3)  # reuses both cached blocks: their hashes leave the cache
    assert pool.events.drain() == [BlockRemoved([b"h2", b"h1"], "CPU")]


@pytest.mark.parametrize("value,match", [('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                                         ('{"enable_kv_cache_events": true, "bufer_steps": 3}', "bufer_steps"),
                                         ('{"hwm": 0}', "hwm"), ("[1]", "JSON object")])
def test_bad_config_names_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        KVEventsConfig.parse(value)


def test_subscriber_sees_stores_hits_evictions_and_can_replay(tiny_models):
    path, hf_model = tiny_models["llama"]
    port, replay_port = _free_port(), _free_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
           "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events"}
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=12, block_size=4,
              kv_events_config=cfg)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.3)  # the subscription reaches the publisher
    decoder = msgspec.msgpack.Decoder(type=VKVEventBatch)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks of 4

    def receive(timeout=5.0) -> list[tuple[int, Any]]:
        got, end = [], time.monotonic() + timeout
        while time.monotonic() < end:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv-events"
                got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
            elif got:
                break
        return got

    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    first = receive()
    stored = [e for _, b in first for e in b.events if isinstance(e, VBlockStored)]
    assert [h for e in stored for h in e.block_hashes][:4] and stored[0].parent_block_hash is None
    assert [t for e in stored for t in e.token_ids][:16] == prompt[:16]
    assert stored[0].block_size == 4 and stored[0].medium == "CPU" and stored[0].lora_id is None
    hashes = [h for e in stored for h in e.block_hashes]

    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # a prefix hit: nothing new stored
    again = [e for _, b in receive(1.5) for e in b.events if isinstance(e, VBlockStored)]
    assert not set(h for e in again for h in e.block_hashes) & set(hashes[:4])

    # other prompts fill the 12-block pool: the first prompt's cached blocks are evicted
    llm.generate([{"prompt_token_ids": list(range(300 + 40 * i, 330 + 40 * i))} for i in range(2)], params,
                 use_tqdm=False)
    later = receive()
    removed = {h for _, b in later for e in b.events if isinstance(e, VBlockRemoved) for h in e.block_hashes}
    assert removed & set(hashes[:4])
    seqs = [s for s, _ in first + later]
    assert seqs == sorted(seqs) and seqs[0] == 0

    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{replay_port}")
    req.send((0).to_bytes(8, "big"))
    replayed = []
    while req.poll(2000):
        seq, payload = req.recv_multipart()
        if not payload:
            break
        replayed.append(int.from_bytes(seq, "big"))
    assert replayed[:len(first)] == [s for s, _ in first]
    for s in (sub, req):
        s.close(0)
    llm.llm_engine.shutdown()  # the publisher's thread ends and its ports close
    assert not llm.llm_engine.kv_event_publisher._thread.is_alive()
