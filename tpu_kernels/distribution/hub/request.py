"""One HTTP request to the local Hub: its headers and query, the caller's standing, its body read under
limits (size, pause, pace), and the URLs it was sent to."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qsl

import anyio
import anyio.from_thread
import anyio.to_thread
from starlette.datastructures import Headers, QueryParams

from .errors import HubError
from .limits import Limits, TransferClock

# A request body beyond this waits on disk (tmp/) until its handler reads it.
BODY_MEMORY_BYTES = 64 << 10
_RESOLVE_PREFIXES = {"kernel": "kernels/", "model": ""}


class ClientGone(Exception):
    """The client closed the connection while its request was being read."""




class HubRequest:
    """One request: its headers and query, the caller's standing, and its body read under limits."""

    def __init__(self, scope, receive, limits: Limits, authenticated: bool, spool_folder: Path):
        self.scope = scope
        self.method: str = scope["method"]
        self.headers = Headers(scope=scope)
        self.query = QueryParams(scope["query_string"])
        self.authenticated = authenticated
        self._receive = receive
        self._limits = limits
        self._spool_folder = spool_folder
        length = self.headers.get("content-length")  # the HTTP layer admits one, all digits
        self.body_length = int(length) if length else None
        self.body_complete = not (self.body_length or "transfer-encoding" in self.headers)
        self.keep_alive = True
        self._clock = TransferClock(limits.body_timeout, limits.min_rate)
        self._received = 0
        self._body: tempfile.SpooledTemporaryFile | None = None

    async def next_chunk(self, limit: int) -> bytes:
        """The next piece of the body, b"" at its end: 413 past `limit` bytes, 408 if it stalls or
        drips slower than the limits allow."""
        if self.body_length is not None and self.body_length > limit:
            raise HubError(413, f"Request body larger than {limit} bytes")
        while not self.body_complete:
            started = time.monotonic()
            try:
                with anyio.fail_after(max(self._clock.remaining(), 0)):
                    message = await self._receive()
            except TimeoutError:
                raise HubError(408, f"Request body stalled or too slow: it may pause {self._limits.body_timeout:g} s "
                                    f"at most, and must average {self._limits.min_rate:g} bytes/s beyond its first "
                                    f"{self._limits.body_timeout:g} s") from None
            if message["type"] == "http.disconnect":
                raise ClientGone()
            self.body_complete = not message.get("more_body", False)
            chunk = message.get("body", b"")
            self._clock.record(time.monotonic() - started, len(chunk))
            self._received += len(chunk)
            if self._received > limit:
                raise HubError(413, f"Request body larger than {limit} bytes")
            if chunk:
                return chunk
        return b""

    async def read_body(self, limit: int) -> None:
        """Receive the whole body: in memory up to BODY_MEMORY_BYTES, on disk beyond."""
        self._body = tempfile.SpooledTemporaryFile(max_size=BODY_MEMORY_BYTES, dir=self._spool_folder)
        while chunk := await self.next_chunk(limit):
            if self._received > BODY_MEMORY_BYTES:
                await anyio.to_thread.run_sync(self._body.write, chunk)
            else:
                self._body.write(chunk)

    @property
    def body_in_memory(self) -> bool:
        return self._received <= BODY_MEMORY_BYTES

    def body(self) -> bytes:
        if self._body is None:
            return b""
        self._body.seek(0)
        return self._body.read()

    def close(self) -> None:
        if self._body is not None:
            self._body.close()

    def read_chunk_from_thread(self, limit: int) -> bytes:
        """next_chunk, for a handler running in a worker thread."""
        return anyio.from_thread.run(self.next_chunk, limit)

    def json(self) -> dict:
        """The body as a JSON object ({} if empty)."""
        try:
            data = json.loads(self.body() or b"{}")
            # json.loads lets a lone surrogate through, escaped (\ud800) or UTF-8-encoded.
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeError:
            raise HubError(400, "Invalid JSON body: not valid Unicode (invalid UTF-8, or a lone surrogate)") from None
        except (ValueError, RecursionError) as error:  # RecursionError: nested too deep for the decoder
            raise HubError(400, f"Invalid JSON body: {error}") from None
        if not isinstance(data, dict):
            raise HubError(400, "Invalid JSON body: expected an object")
        return data

    def form_values(self, name: str) -> Iterator[str]:
        """The values of one field of the urlencoded body, parsed a piece of the body at a time: an
        anonymous request's body never sits in memory whole."""
        if self._body is None:
            return
        self._body.seek(0)
        pending = b""
        while True:
            piece = self._body.read(BODY_MEMORY_BYTES)
            fields = (pending + piece).split(b"&")
            pending = fields.pop() if piece else b""
            try:
                for key, value in parse_qsl(b"&".join(fields).decode(), errors="strict"):
                    if key == name:
                        yield value
            except UnicodeDecodeError:
                raise HubError(400, "Invalid form body: not UTF-8") from None
            if not piece:
                return

    def base_url(self) -> str:
        """The server's URL as this request named it (its Host), else the address it arrived at."""
        host = self.headers.get("host")
        if not host:
            address, port = self.scope["server"][:2]
            host = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
        return f"http://{host}"

    def repo_url(self, repo_type: str, repo_id: str) -> str:
        return f"{self.base_url()}/{_RESOLVE_PREFIXES[repo_type]}{repo_id}"


def json_field(payload: dict, name: str, kinds: type | tuple[type, ...], where: str = ""):
    """payload[name] if it is one of `kinds` (missing counts as None); else a 400 naming the field."""
    value = payload.get(name)
    if not isinstance(value, kinds):
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        expected = " or ".join("null" if kind is type(None) else kind.__name__ for kind in kinds)
        label = f"{where}{name}"
        raise HubError(400, f"Invalid field {label!r}: expected {expected}, got {type(value).__name__}")
    return value
