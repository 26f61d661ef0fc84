"""The HTTP/1.1 protocol the server runs (uvicorn's h11 one, with a deadline for request heads).

uvicorn closes a keep-alive connection that sends nothing for timeout_keep_alive seconds, but a fresh
connection that sends nothing, or one that sends its request head a byte at a time (slowloris), is
kept for ever: two hundred of them hold two hundred sockets and their buffers.  Here every connection
must have sent a complete request head within head_timeout_s of opening (or of its previous answer),
else it is closed.  The body has its own deadline (serving_engine.read_json_body, a 408).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


def head_deadline_protocol(head_timeout_s: float) -> type:
    """uvicorn's H11Protocol with a request-head deadline of head_timeout_s seconds."""

    class HeadDeadlineProtocol(H11Protocol):
        _head_timer: Optional[asyncio.TimerHandle] = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_deadline(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            if not self.transport.is_closing():
                self._head_timer = self.loop.call_later(head_timeout_s, self._head_deadline_passed)

        def _head_deadline_passed(self) -> None:
            self._head_timer = None
            # IDLE: no complete request head yet (nothing sent, or a head still trickling in)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.debug("closing a connection with no complete request head after %.0f s", head_timeout_s)
                try:
                    self.conn.send(h11.ConnectionClosed())
                except h11.LocalProtocolError:
                    pass
                self.transport.close()

    return HeadDeadlineProtocol
