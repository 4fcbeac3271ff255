"""What one client may cost the local Hub: time, connections and bytes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Defaults suit a registry on a trusted network; tests shrink the timeouts.

    header_timeout: seconds from a connection's opening (or the first byte of its next
        request) to the end of the request's headers; then the connection is closed.
    idle_timeout: seconds a kept-alive connection may wait for its next request.
    body_timeout: seconds a request body may stall (no byte arriving) before a 408; also the
        grace period of `min_rate` for bodies.
    send_timeout: seconds the client may leave a response unread (no byte taken) before the
        connection is dropped; also the grace period of `min_rate` for responses.
    min_rate: bytes per second a request body or a response must average, counting only the
        time the server waits for the client, once its grace period is spent: a transfer may
        keep the server waiting `grace + bytes moved / min_rate` seconds in all.
    max_connections: open connections; one more is answered 503 and closed at once.
    max_header_bytes: request line plus headers, however they arrive; more is a 431 (or a 400
        while they are still arriving).
    max_json_bytes: a JSON or form body (repo creation, preupload, paths-info, ...); more is a 413.
    max_commit_bytes: a commit's NDJSON body (files travel base64-encoded inside it); more is a 413.
    max_front_matter_bytes: the YAML front matter /api/validate-yaml parses; more is a 400.
    max_concurrent_commits: commit bodies received at once; more wait for a slot.
    max_large_bodies: JSON or form bodies larger than what a request keeps in memory (64 KiB;
        the rest waits on disk) parsed at once; more wait for a slot.
    """

    header_timeout: float = 10.0
    idle_timeout: float = 15.0
    body_timeout: float = 30.0
    send_timeout: float = 30.0
    min_rate: float = 16 << 10
    max_connections: int = 256
    max_header_bytes: int = 32 << 10
    max_json_bytes: int = 4 << 20
    max_commit_bytes: int = 1 << 30
    max_front_matter_bytes: int = 64 << 10
    max_concurrent_commits: int = 8
    max_large_bodies: int = 2

    def __post_init__(self):
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"Limits.{name} must be positive, not {value!r}")


class TransferClock:
    """How long one transfer may keep the server waiting for its client.

    At most `grace` seconds without a byte moving, and at most `grace + moved / min_rate`
    seconds of waiting in all: a client that keeps up `min_rate` never runs out, one that
    drips bytes to dodge the stall limit does.
    """

    def __init__(self, grace: float, min_rate: float):
        self.grace = grace
        self.min_rate = min_rate
        self.waited = 0.0
        self.moved = 0
        self._since_progress = 0.0

    def record(self, waited: float, moved: int) -> None:
        self.waited += waited
        self.moved += moved
        self._since_progress = 0.0 if moved else self._since_progress + waited

    def remaining(self) -> float:
        """Seconds the client may still keep the server waiting (<= 0: its time is up)."""
        return min(self.grace - self._since_progress, self.grace + self.moved / self.min_rate - self.waited)
