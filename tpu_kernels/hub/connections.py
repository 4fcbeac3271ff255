"""HTTP/1.1 connections: uvicorn's h11 protocol, plus what it lacks against clients that stall.

uvicorn closes a kept-alive connection that stays idle after a response
(`timeout_keep_alive`), answers 400 to malformed requests (h11 parses strictly:
one Content-Length, all digits, no conflicting duplicates) and caps header size.
It has no deadline for a request's headers, though: a connection that never
sends a full request stays open for ever. This adds that deadline and a cap on
open connections.
"""

from __future__ import annotations

import asyncio
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import Limits

_TOO_MANY_BODY = b"Too many open connections: try again shortly\n"
_TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nretry-after: 1\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TOO_MANY_BODY), _TOO_MANY_BODY)
)
_TIMED_OUT_BODY = b"Request headers not received in time\n"
_TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TIMED_OUT_BODY), _TIMED_OUT_BODY)
)


class HubHTTPProtocol(H11Protocol):
    """One connection: at most `limits.header_timeout` seconds to deliver each request's headers."""

    def __init__(self, *args, limits: Limits, **kwargs):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._header_deadline: asyncio.TimerHandle | None = None
        self._partial_headers = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # Headers and body leave in separate writes: with Nagle's algorithm the body would wait
        # for the client's delayed ACK, ~40 ms per request. (asyncio sets this itself only on
        # sockets whose `proto` field says TCP, which a listening socket made without one lacks.)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.connections) > self._limits.max_connections:
            transport.write(_TOO_MANY)
            transport.close()
            return
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._header_deadline is None and self.conn.their_state is h11.IDLE:
            # The first byte of a request that follows a response: its headers' clock starts.
            self._await_headers()
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._partial_headers = True
        else:
            self._stop_header_clock()

    def connection_lost(self, exc) -> None:
        self._stop_header_clock()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._partial_headers = False
        self._header_deadline = self.loop.call_later(self._limits.header_timeout, self._headers_too_slow)

    def _stop_header_clock(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            if self._partial_headers:
                self.transport.write(_TIMED_OUT)
            self.transport.close()
