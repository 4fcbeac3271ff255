"""HTTP/1.1 connections: uvicorn's h11 protocol, plus what it lacks against clients that stall.

uvicorn closes a kept-alive connection that stays idle after a response
(`timeout_keep_alive`), answers 400 to malformed requests (h11 parses strictly:
one Content-Length, all digits, no conflicting duplicates) and caps the size of
headers still arriving. It has no deadline for a request's headers, though, nor
for a client that does not read its responses: either would hold a connection
for ever. This adds both, and a cap on open connections.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import sys
import termios
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import Limits, TransferClock

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


class _CountingTransport:
    """The connection's transport, counting the bytes written to it (asyncio's does not), and
    telling the protocol when it is closed with bytes still unsent."""

    def __init__(self, transport: asyncio.Transport, on_close_pending):
        self._transport = transport
        self._on_close_pending = on_close_pending
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self._transport.write(data)

    def close(self) -> None:
        self._transport.close()
        if self._transport.get_write_buffer_size():
            self._on_close_pending()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class HubHTTPProtocol(H11Protocol):
    """One connection: at most `limits.header_timeout` seconds to deliver each request's headers,
    and responses read at `limits.min_rate` after `limits.send_timeout` seconds of grace."""

    def __init__(self, *args, limits: Limits, **kwargs):
        super().__init__(*args, **kwargs)
        self._limits = limits
        self._header_deadline: asyncio.TimerHandle | None = None
        self._partial_headers = False
        self._send_clock = TransferClock(limits.send_timeout, limits.min_rate)
        self._send_deadline: asyncio.TimerHandle | None = None
        self._send_mark: float | None = None  # when the server last began, or went on, waiting for the client
        self._acknowledged_before = 0

    def connection_made(self, transport) -> None:
        super().connection_made(_CountingTransport(transport, on_close_pending=self._await_reader))
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
        self._stop_send_clock()
        super().connection_lost(exc)

    # -- request headers ------------------------------------------------------------------------

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

    # -- responses ------------------------------------------------------------------------------
    # asyncio pauses writing when the bytes the kernel has not taken pass its high-water mark:
    # from then until it resumes, the server waits for the client to read. What the client read
    # is what its TCP acknowledged: the kernel's send buffer (megabytes, autotuned) hides it from
    # asyncio, which may see no progress for seconds while a client reads at a good pace.

    def pause_writing(self) -> None:
        super().pause_writing()
        self._await_reader()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_clock()

    def _acknowledged(self) -> int:
        """Bytes of responses the client's TCP has acknowledged (so far as this platform tells)."""
        return (self.transport.written - self.transport.get_write_buffer_size()
                - _unacknowledged(self.transport.get_extra_info("socket")))

    def _await_reader(self) -> None:
        if self._send_mark is None:
            acknowledged = self._acknowledged()
            self._send_clock.record(0.0, acknowledged - self._acknowledged_before)
            self._acknowledged_before = acknowledged
            self._send_mark = time.monotonic()
            self._send_deadline = self.loop.call_later(max(self._send_clock.remaining(), 0), self._check_reader)

    def _account_wait(self) -> None:
        now, acknowledged = time.monotonic(), self._acknowledged()
        self._send_clock.record(now - self._send_mark, acknowledged - self._acknowledged_before)
        self._send_mark, self._acknowledged_before = now, acknowledged

    def _stop_send_clock(self) -> None:
        if self._send_mark is not None:
            self._account_wait()
            self._send_mark = None
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _check_reader(self) -> None:
        self._send_deadline = None
        self._account_wait()
        remaining = self._send_clock.remaining()
        if remaining > 0:
            self._send_deadline = self.loop.call_later(remaining, self._check_reader)
        else:
            # close() would wait for the client to take the unsent bytes: drop them.
            self.transport.abort()


def _unacknowledged(sock) -> int:
    """Bytes in the socket's send queue the peer has not acknowledged; 0 where the platform does not say."""
    if sys.platform != "linux" or sock is None or sock.fileno() < 0:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError:  # closed meanwhile
        return 0
