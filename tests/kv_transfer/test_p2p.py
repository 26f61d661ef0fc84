"""P2pConnector: the decode engine pulls a prompt's KV blocks from the prefill engine's pool over TCP.
Greedy output through the router equals HF's; the decoder fetches only the blocks its own prefix cache
lacks; and the faults end in a recompute or a clear error with every KV block back in both pools:
the prefill engine gone before or during the pull, a pull that never gets an answer, the decode engine
gone (the prefill's held blocks time out), and a client that leaves mid-answer."""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
import pytest
import torch

from roofline.attention import kv_spec
from roofline.kv_transfer.p2p import LayerHeader, Pull, PullReply, recv_msg, send_msg
from roofline.metrics.prometheus import metric_value
from tests.reference.hf_models import hf_greedy
from tests.router.cluster import (BLOCK, assert_kv_idle, client, completion, free_port, metrics, start_engine,
                                  start_router, stop)

MAX_TOKENS = 8


def p2p(role: str, port: int = 0, policy: str = "recompute", **extra) -> dict:
    return {"kv_connector": "P2pConnector", "kv_role": role, "kv_ip": "127.0.0.1", "kv_port": port,
            "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + 7 * n + salt) % 370 + 7 for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def pd(tiny):
    path, _ = tiny
    prefill = start_engine(path, p2p("kv_producer", free_port(), send_timeout_s=2.0))
    decode = start_engine(path, p2p("kv_consumer", transfer_timeout_s=5.0))
    router = start_router(prefill=[prefill.url], decode=[decode.url])
    yield prefill, decode, router
    stop(router, prefill, decode)


def received(server) -> float:
    return metric_value(metrics(server.url), "roofline:kv_transfer_received_bytes_total")


def block_bytes(hf) -> int:
    """One KV block of the tiny model in fp32, from its config (the engine's core may live in another process)."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    specs = [kv_spec.attention_spec(c.num_key_value_heads, head_dim)] * c.num_hidden_layers
    return kv_spec.bytes_per_block(specs, BLOCK, torch.float32)


def test_pd_p2p_through_router_matches_hf(tiny, pd):
    _, hf = tiny
    prefill, decode, router = pd
    before = received(decode)
    lens = (3, 8, 9, 30, 41)
    for n in lens:
        p = prompt(n)
        expected = hf_greedy(hf, p, MAX_TOKENS)
        assert completion(router.url, p, MAX_TOKENS) == expected
        assert completion(router.url, p, MAX_TOKENS, stream=True) == expected
    assert_kv_idle(prefill, decode)
    # the first time a prompt comes, the blocks of every prompt token but the last travel (the last one
    # partial); the second time (same prompt) the decoder's prefix cache has the full ones and only a
    # partial last block travels again (a prompt of whole blocks but one token: nothing, the producer's
    # copy is released)
    first = sum(-(-(n - 1) // BLOCK) for n in lens)
    again = sum(1 for n in lens if (n - 1) % BLOCK)
    assert received(decode) - before == (first + again) * block_bytes(hf)
    sent = metric_value(metrics(prefill.url), "roofline:kv_transfer_sent_bytes_total")
    assert sent >= received(decode) - before


def test_decoder_fetches_only_blocks_it_lacks(tiny, pd):
    _, hf = tiny
    prefill, decode, router = pd
    base = prompt(40, salt=3)
    assert completion(router.url, base, MAX_TOKENS) == hf_greedy(hf, base, MAX_TOKENS)
    before = received(decode)
    other = base[:24] + prompt(16, salt=9)  # shares 3 blocks with base; 39 loadable tokens: 2 blocks to pull
    out = completion(router.url, other, MAX_TOKENS)
    assert out == hf_greedy(hf, other, MAX_TOKENS)
    assert received(decode) - before == 2 * block_bytes(hf)
    assert_kv_idle(prefill, decode)


def prefill_only(prefill_url: str, p: list[int]) -> dict:
    r = httpx.post(prefill_url + "/v1/completions", timeout=30,
                   json=dict(prompt=p, max_tokens=1, temperature=0.0, kv_transfer_params={"do_remote_decode": True}))
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_prefill_engine_gone_before_the_pull(tiny):
    """One prefill engine hands a prompt each to a decode engine of either kv_load_failure_policy, then goes
    away before they pull: "recompute" gives HF's tokens, "fail" a clear error, every block back in both."""
    path, hf = tiny
    prefill = start_engine(path, p2p("kv_producer", free_port()))
    decodes = {policy: start_engine(path, p2p("kv_consumer", policy=policy, transfer_timeout_s=2.0))
               for policy in ("recompute", "fail")}
    try:
        handed = {}
        for salt, policy in enumerate(decodes):
            p = prompt(33, salt=salt)
            params = prefill_only(prefill.url, p)
            assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 4, (policy, params)
            handed[policy] = p, params
        stop(prefill)
        for policy, (p, params) in handed.items():
            body = dict(prompt=p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0,
                        kv_transfer_params=params)
            r = httpx.post(decodes[policy].url + "/v1/completions", json=body, timeout=30)
            if policy == "recompute":
                assert r.status_code == 200, (policy, r.text)
                toks = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
                assert toks == hf_greedy(hf, p, MAX_TOKENS), policy
            else:
                assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", (policy, r.text)
            assert_kv_idle(decodes[policy])
    finally:
        stop(*decodes.values())


class FakeProducer:
    """A producer that answers a pull in a broken way: never (hang), or dying halfway through a layer."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.pulls = 0
        self.conns = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            recv_msg(conn, Pull)  # the pull itself: this fake answers whatever it asks
            self.pulls += 1
            if self.mode == "die_mid_layer":
                send_msg(conn, PullReply(True, num_layers=2))
                send_msg(conn, LayerHeader(0, 1 << 20))
                conn.sendall(b"\0" * 1000)
                conn.close()
            # "hang": read the pull, say nothing

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture(scope="module")
def impatient_decode(tiny):
    """A decode engine that gives a transfer 1 s, shared by both broken producers."""
    path, _ = tiny
    decode = start_engine(path, p2p("kv_consumer", transfer_timeout_s=1.0))
    yield decode
    stop(decode)


@pytest.mark.parametrize("mode", ["hang", "die_mid_layer"])
def test_transfer_that_never_completes_is_recomputed(tiny, impatient_decode, mode):
    _, hf = tiny
    fake = FakeProducer(mode)
    decode = impatient_decode
    try:
        p = prompt(25, salt=len(mode))  # a prompt of its own per mode: none of its blocks in the decoder's cache
        params = {"do_remote_prefill": True, "remote_engine_id": "fake", "remote_request_id": "cmpl-x",
                  "remote_block_ids": [5, 6, 7], "remote_host": "127.0.0.1", "remote_port": fake.port}
        t0 = time.monotonic()
        assert completion(decode.url, p, MAX_TOKENS, kv_transfer_params=params) == hf_greedy(hf, p, MAX_TOKENS)
        assert fake.pulls == 1
        if mode == "hang":
            assert time.monotonic() - t0 >= 1.0  # it waited for the transfer timeout, then recomputed
        assert_kv_idle(decode)
    finally:
        fake.close()


def held_blocks(server) -> float:
    m = metrics(server.url)
    return metric_value(m, "roofline:kv_cache_num_blocks") - metric_value(m, "roofline:kv_cache_num_free_blocks")


@pytest.fixture(scope="module")
def patient_prefill(tiny):
    """A prefill engine that holds a prompt's blocks for 60 s, and its KV port: the two tests below each
    end its hold early, and check that every block is back."""
    path, _ = tiny
    port = free_port()
    prefill = start_engine(path, p2p("kv_producer", port, send_timeout_s=60.0))
    yield prefill, port
    stop(prefill)


def test_decode_engine_gone_frees_the_held_prefill_at_once(patient_prefill):
    """No decode engine takes the prefill's KV: the router tells the prefill engine, which frees the held
    blocks at once, long before its send timeout (60 s here)."""
    prefill, _ = patient_prefill
    router = start_router(prefill=[prefill.url], decode=[f"http://127.0.0.1:{free_port()}"])
    try:
        t0 = time.monotonic()
        r = httpx.post(router.url + "/v1/completions", timeout=30,
                       json=dict(prompt=prompt(30), max_tokens=MAX_TOKENS, temperature=0.0))
        assert r.status_code == 503 and "no healthy decode engine" in r.json()["error"]["message"]
        assert_kv_idle(prefill, timeout=5)
        assert time.monotonic() - t0 < 10
    finally:
        stop(router)


def test_consumer_gone_mid_pull_frees_the_held_blocks_at_once(patient_prefill):
    """A consumer that asks for the blocks and dies after the first layer: the producer sees the
    connection close and frees the hold then, not at its send timeout (60 s here)."""
    prefill, port = patient_prefill
    params = prefill_only(prefill.url, prompt(33))
    assert held_blocks(prefill) == -(-33 // BLOCK)  # the blocks of all 33 tokens
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        send_msg(sock, Pull(params["remote_request_id"], params["remote_block_ids"]))
        assert recv_msg(sock, PullReply).ok
        recv_msg(sock, LayerHeader)  # the first layer's header: the transfer is under way; now die
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a kill
    assert_kv_idle(prefill, timeout=5)


def test_unclaimed_prefill_is_held_until_the_send_timeout(tiny):
    """Nobody comes and nobody says: the blocks stay held for the consumer, then go at send_timeout_s."""
    path, _ = tiny
    prefill = start_engine(path, p2p("kv_producer", free_port(), send_timeout_s=2.0))
    try:
        t0 = time.monotonic()
        params = prefill_only(prefill.url, prompt(30))
        time.sleep(1.0)
        assert held_blocks(prefill) == -(-30 // BLOCK) and params["remote_block_ids"]
        assert_kv_idle(prefill, timeout=10)
        assert time.monotonic() - t0 >= 2.0
    finally:
        stop(prefill)


def aborts(server) -> float:
    return metric_value(metrics(server.url), "roofline:request_success_total", finish_reason="abort")


def test_client_leaving_mid_stream_aborts_on_both_engines(tiny, pd):
    prefill, decode, router = pd
    before = aborts(decode)
    body = dict(prompt=prompt(30, salt=5), max_tokens=450, temperature=0.0, ignore_eos=True, stream=True)
    with client(30) as c:
        with c.stream("POST", router.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one token, then the client is gone
    deadline = time.monotonic() + 30
    while aborts(decode) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts(decode) == before + 1
    assert_kv_idle(prefill, decode)


def test_pull_pacer_keeps_the_pull_to_its_share_of_the_core():
    from roofline.kv_transfer.p2p import PullPacer

    assert PullPacer(0.25).rest_after(0.010) == pytest.approx(0.030)  # 10 ms of work, 30 ms of rest: 25%
    assert PullPacer(0.5).rest_after(0.004) == pytest.approx(0.004)
    assert PullPacer(1.0).rest_after(5.0) == 0.0  # flat out


@pytest.mark.parametrize("share", [0, -0.5, 1.5, "fast", True])
def test_bad_max_pull_share_fails_at_start_naming_the_field(share):
    import json

    from roofline.config import KVTransferConfig
    from roofline.kv_transfer.p2p import P2pScheduler

    config = KVTransferConfig.from_json(json.dumps(p2p("kv_consumer", max_pull_share=share)))
    with pytest.raises(ValueError, match="max_pull_share"):
        P2pScheduler(config, BLOCK)


def test_torch_distributed_transport_matches_hf(tiny):
    """transport "torch": the tensors travel over a per-pull two-rank process group (gloo here, NCCL for CUDA
    pools) instead of the socket; same tokens, same bytes, every block back in both pools."""
    path, hf = tiny
    prefill = start_engine(path, p2p("kv_producer", free_port(), transport="torch"))
    decode = start_engine(path, p2p("kv_consumer", transport="torch", transfer_timeout_s=10.0))
    router = start_router(prefill=[prefill.url], decode=[decode.url])
    try:
        lens = (9, 30, 41)
        for n in lens:
            p = prompt(n, salt=5)
            assert completion(router.url, p, MAX_TOKENS, stream=True) == hf_greedy(hf, p, MAX_TOKENS)
        assert received(decode) == sum(-(-(n - 1) // BLOCK) for n in lens) * block_bytes(hf)
        assert_kv_idle(prefill, decode)
    finally:
        stop(router, prefill, decode)


def test_unknown_transport_fails_at_start_naming_the_field():
    import json

    from roofline.config import KVTransferConfig
    from roofline.kv_transfer.p2p import P2pScheduler

    config = KVTransferConfig.from_json(json.dumps(p2p("kv_consumer", transport="carrier-pigeon")))
    with pytest.raises(ValueError, match="transport"):
        P2pScheduler(config, BLOCK)


def test_producer_frees_a_hold_when_its_consumer_breaks_the_pull():
    """The producer's side alone, with layers far larger than the socket buffers (8 MB a pull each), so
    the consumer's reset lands while the producer is still sending: the hold is reported finished (its
    blocks go back to the pool) at once, and it is served no more."""
    from roofline.config import KVTransferConfig
    from roofline.core.kv_connector_messages import KVConnectorMetadata
    from roofline.kv_transfer.p2p import P2pWorker

    port = free_port()
    config = KVTransferConfig("P2pConnector", "kv_producer", "127.0.0.1", port,
                              kv_connector_extra_config={"send_timeout_s": 60.0})
    caches = [torch.zeros(2, 16, 16, 8, 1024) for _ in range(3)]  # [K/V, blocks, block size, heads, head dim]
    worker = P2pWorker(config, caches, 16)
    try:
        worker.start_load_kv(KVConnectorMetadata(sends={"req-1": list(range(8))}))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            send_msg(sock, Pull("req-1", list(range(8))))
            assert recv_msg(sock, PullReply).ok
            recv_msg(sock, LayerHeader)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a kill
        deadline = time.monotonic() + 5
        done = []
        while not done and time.monotonic() < deadline:
            out = worker.get_finished()
            done = out.finished_sending if out is not None else []
            time.sleep(0.02)
        assert done == ["req-1"] and "req-1" not in worker._sends  # never served again
    finally:
        worker.shutdown()
