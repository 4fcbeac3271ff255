"""What one client may cost the local Hub: time, connections and bytes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """Defaults suit a registry on a trusted network; tests shrink the timeouts.

    header_timeout: seconds from a connection's opening (or the first byte of its next
        request) to the end of the request's headers; then the connection is closed.
    idle_timeout: seconds a kept-alive connection may wait for its next request.
    body_timeout: seconds a request body may stall (no byte arriving) before a 408.
    max_connections: open connections; one more is answered 503 and closed at once.
    max_header_bytes: request line plus headers; more is a 400.
    max_json_bytes: a JSON or form body (repo creation, preupload, paths-info, ...); more is a 413.
    max_commit_bytes: a commit's NDJSON body (files travel base64-encoded inside it); more is a 413.
    max_front_matter_bytes: the YAML front matter /api/validate-yaml parses; more is a 400.
    max_concurrent_commits: commit bodies received at once; more wait for a slot.
    """

    header_timeout: float = 10.0
    idle_timeout: float = 15.0
    body_timeout: float = 30.0
    max_connections: int = 256
    max_header_bytes: int = 32 << 10
    max_json_bytes: int = 4 << 20
    max_commit_bytes: int = 1 << 30
    max_front_matter_bytes: int = 64 << 10
    max_concurrent_commits: int = 8

    def __post_init__(self):
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"Limits.{name} must be positive, not {value!r}")
