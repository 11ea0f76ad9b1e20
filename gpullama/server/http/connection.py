"""HTTP/1.1 connections with a deadline for each request head (uvicorn's h11 protocol, one timer added).

uvicorn closes a keep-alive connection that stays idle after a response, but only until its first byte arrives,
and never times out a new connection: an idle socket, or one that sends its headers a byte a second, is held
forever. Here each connection must deliver a complete request line and headers within `header_timeout` seconds
of opening, or of its previous response; otherwise it is closed. (The body has its own deadline, in the app.)
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("gpullama.server")


class HeadTimeoutProtocol(H11Protocol):
    """`H11Protocol` that closes a connection whose request head is not complete within `header_timeout` s."""

    header_timeout: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
            self._disarm()  # a whole request head has arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # the next request's head has its own deadline

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            where = "%s:%d" % self.client if self.client else "-"
            log.info("closing the connection from %s: no complete request head within %gs (--header-timeout)",
                     where, self.header_timeout)
            self.transport.close()


def head_timeout_protocol(header_timeout: float) -> type[HeadTimeoutProtocol]:
    """The protocol class to hand uvicorn (``Config(http=...)``) for a given head deadline in seconds."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"header_timeout": header_timeout})
