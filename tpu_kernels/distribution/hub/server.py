"""Running the local Hub: `start_hub` (a background thread) and `tpu-kernels serve` (the foreground).

HTTP stack: uvicorn (its pure-Python h11 protocol) and starlette's request and
response types, both installed with this package. They parse requests strictly
(a malformed or conflicting Content-Length is a 400, never a dropped connection),
bound the size of headers still arriving, close idle kept-alive connections, and
serve files with ranges. connections.py adds a deadline for request headers, a
minimum pace for reading responses and a cap on open connections; request.py bounds
bodies in size and pace, app.py headers in size however they arrive, and refuses
ambiguous framing and (through access.py) unknown Host names. One event loop thread holds every
connection (an idle one costs a socket, not a thread); handlers run in worker
threads because storage does blocking file I/O and fsyncs.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from .access import LOOPBACK_NAMES, USER_NAME, normalize_token
from .app import STATS_PATH, HubApp
from .connections import HubHTTPProtocol
from .limits import Limits
from .storage import Storage

__all__ = ["DEFAULT_PORT", "STATS_PATH", "TOKEN_ENV", "USER_NAME", "RunningHub", "serve_main", "start_hub"]

DEFAULT_PORT = 8765
TOKEN_ENV = "TPU_KERNELS_HUB_TOKEN"
# How long stop() lets requests in flight finish before cancelling them.
GRACEFUL_SHUTDOWN_SECONDS = 5


class RunningHub:
    """A hub server running in a background thread of this process."""

    def __init__(self, app: HubApp, listener: socket.socket, log_requests: bool):
        self._app = app
        config = uvicorn.Config(
            app,
            loop="asyncio",
            http=functools.partial(HubHTTPProtocol, limits=app.limits),
            ws="none",
            lifespan="off",
            interface="asgi3",
            log_config=None,
            access_log=log_requests,
            proxy_headers=False,
            server_header=False,
            headers=[("server", "tpu-kernels-hub")],
            timeout_keep_alive=app.limits.idle_timeout,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            h11_max_incomplete_event_size=app.limits.max_header_bytes,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listener]}, name="tpu-kernels-hub", daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the hub server failed to start (see the log above)")
            time.sleep(0.002)
        host, port = listener.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def storage(self) -> Storage:
        return self._app.storage

    @property
    def token(self) -> str | None:
        """The token writes need, None if the server is read-only."""
        return self._app.access.token

    @property
    def request_count(self) -> int:
        return self._app.stats.snapshot()["requests"]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        self._app.storage.close()

    def __enter__(self) -> RunningHub:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Many clients (e.g. 8 processes x 8 download threads) connect at once.
    return socket.create_server((host, port), family=family, backlog=128)


def start_hub(
    root: str | Path,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    trusted_orgs=(),
    log_requests: bool = False,
    limits: Limits | None = None,
    allowed_hosts=(),
) -> RunningHub:
    """Serve `root` in a background thread; `port=0` picks a free port. Use as a context manager or call stop().

    An empty or blank token is no token: the server is then read-only. Requests must name in
    their Host an IP address, `localhost`, `host`, or one of `allowed_hosts` ("*": any name).
    """
    storage = Storage(Path(root))
    try:
        app = HubApp(storage, token, trusted_orgs, limits or Limits(),
                     host_names=LOOPBACK_NAMES | {host} | set(allowed_hosts))
        listener = _listen(host, port)
        try:
            return RunningHub(app, listener, log_requests)
        except BaseException:
            listener.close()
            raise
    except BaseException:
        storage.close()
        raise


def describe(hub: RunningHub, trusted_orgs) -> str:
    lines = [f"tpu-kernels hub serving {hub.storage.root} at {hub.url}"]
    if hub.token:
        lines.append("writes need the token (clients: HF_TOKEN)")
    else:
        lines.append(f"read-only: no token given (--token or ${TOKEN_ENV}; an empty one counts as none)")
    if trusted_orgs:
        lines.append(f"trusted kernel publishers: {', '.join(sorted(trusted_orgs))}")
    lines.append(f"clients: export HF_ENDPOINT={hub.url}")
    lines.append(f"browse it: {hub.url}/")
    return "\n".join(lines)


def warn_if_exposed(host: str) -> None:
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: serving plain HTTP on {host}: the token travels unencrypted; "
            "put the server behind TLS or keep it on a trusted network",
            file=sys.stderr,
        )


def _log_to_stderr(log_requests: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    for name, level in (("uvicorn.error", logging.WARNING), ("tpu_kernels.distribution.hub", logging.WARNING),
                        ("uvicorn.access", logging.INFO if log_requests else logging.WARNING)):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False


def serve_main(argv: list[str] | None = None) -> int:
    """`tpu-kernels serve`: run the hub in the foreground until SIGINT/SIGTERM."""
    defaults = Limits()
    parser = argparse.ArgumentParser(
        prog="tpu-kernels serve",
        description="Serve a local Hub that huggingface_hub and kernels talk to (set HF_ENDPOINT to its URL).",
    )
    parser.add_argument("--root", required=True, type=Path, help="folder holding the repos (created if missing)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 picks one)")
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"token that writes must present (default: ${TOKEN_ENV}); without one (or an empty one) "
             "the server is read-only",
    )
    parser.add_argument(
        "--trusted-org", dest="trusted_orgs", action="extend", nargs="+", default=[], metavar="ORG",
        help="organizations whose kernels load without trust_remote_code",
    )
    parser.add_argument("--header-timeout", type=float, default=defaults.header_timeout, metavar="SECONDS",
                        help="close a connection whose request headers take longer (default: %(default)s)")
    parser.add_argument("--idle-timeout", type=float, default=defaults.idle_timeout, metavar="SECONDS",
                        help="close a kept-alive connection idle this long (default: %(default)s)")
    parser.add_argument("--allowed-host", dest="allowed_hosts", action="append", default=[], metavar="NAME",
                        help="a name clients reach this server by (its Host header): IP addresses, localhost and "
                             "--host are always accepted; '*' accepts any name (no DNS-rebinding defence)")
    parser.add_argument("--body-timeout", type=float, default=defaults.body_timeout, metavar="SECONDS",
                        help="answer 408 when a request body stalls this long (default: %(default)s)")
    parser.add_argument("--send-timeout", type=float, default=defaults.send_timeout, metavar="SECONDS",
                        help="drop a connection whose client reads nothing of a response this long "
                             "(default: %(default)s)")
    parser.add_argument("--min-rate", type=float, default=defaults.min_rate, metavar="BYTES_PER_S",
                        help="pace a request body or a response must average after its first --body-timeout "
                             "(--send-timeout) seconds of waiting for the client (default: %(default)g)")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections, metavar="N",
                        help="open connections at most; more are answered 503 (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="do not log requests")
    args = parser.parse_args(argv)
    try:
        limits = Limits(header_timeout=args.header_timeout, idle_timeout=args.idle_timeout,
                        body_timeout=args.body_timeout, send_timeout=args.send_timeout, min_rate=args.min_rate,
                        max_connections=args.max_connections)
    except ValueError as error:
        parser.error(str(error))
    if args.token is not None and normalize_token(args.token) is None:
        print("warning: the token is empty: serving read-only", file=sys.stderr)
    warn_if_exposed(args.host)
    _log_to_stderr(log_requests=not args.quiet)
    hub = start_hub(args.root, args.host, args.port, args.token, args.trusted_orgs,
                    log_requests=not args.quiet, limits=limits, allowed_hosts=args.allowed_hosts)
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    print(describe(hub, args.trusted_orgs), flush=True)
    stopped.wait()
    hub.stop()
    return 0
