"""The server's listening socket (bind_socket): the connections it accepts have Nagle's algorithm off, as
asyncio sets it for TCP sockets whose protocol says TCP.  With it on, a response written in two pieces
(uvicorn writes the head, then the body; a stream writes one event at a time) waited for the client's
delayed ACK: 44 ms per response on a kept-alive connection."""

from __future__ import annotations

import asyncio
import socket

import pytest

from roofline.entrypoints.openai.server import bind_socket


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_nagle_off(host):
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    listener = bind_socket(host, 0)
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport) -> None:  # what uvicorn's protocol is handed
            sock = transport.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Probe, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection(host, port)
        while not seen:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    try:
        asyncio.run(asyncio.wait_for(run(), 10))
    except OSError as e:  # ::1 not configured on this machine's loopback
        pytest.skip(f"cannot serve on {host}: {e}")
    assert seen and seen[0] != 0

