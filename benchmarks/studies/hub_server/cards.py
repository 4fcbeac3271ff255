"""The `cards` group's cases beyond `card_page`: what a page costs the server when its card or its versions are
built to be costly (issue 64: the table card, many cards evicting the expensive one, hundreds of versions)."""

from __future__ import annotations

import json
from pathlib import Path

from .client import HEADER, REPO, Server, commit, create_repo, file_line, request, server

# 16 tables of one-character rows under a 182-column header: markdown-it fills in 65,522 empty cells per
# table, 3.2M tokens from 23 KB.
TABLE_CARD = ("|a" * 182 + "\n" + "|-" * 182 + "\n" + "a\n" * 362 + "\n").encode() * 16
# 512 KiB of `![`: seconds of CPU to parse, and a small page.
BANG_CARD = b"![" * (256 << 10)
CHEAP_CARDS = 40
VERSION_BRANCHES = 300


def _view(srv: Server, path: str) -> dict:
    """One anonymous GET of a page: its status, the server's CPU seconds and peak RSS growth (MiB) for it."""
    cpu, peak = srv.cpu_seconds(), srv.status("VmHWM")
    status, _ = request(srv, "GET", path, token=None)
    return {"status": status, "cpu_s": round(srv.cpu_seconds() - cpu, 2),
            "peak_rss_growth_mib": round((srv.status("VmHWM") - peak) / 1024, 1)}


def table_card(code: Path, work: Path) -> dict:
    """The 23 KB card of 16 tables: two anonymous views of its page."""
    with server(code, work, "table-card") as srv:
        create_repo(srv)
        commit(srv, [HEADER, file_line("README.md", TABLE_CARD)])
        return {"card_kb": round(len(TABLE_CARD) / 1e3), "first_view": _view(srv, f"/kernels/{REPO}"),
                "second_view": _view(srv, f"/kernels/{REPO}")}


def _create(srv: Server, repo_id: str) -> None:
    namespace, name = repo_id.split("/")
    request(srv, "POST", "/api/repos/create", json.dumps({"name": name, "organization": namespace,
                                                          "type": "kernel"}).encode())


def _commit(srv: Server, repo_id: str, lines: list[bytes]) -> int:
    return request(srv, "POST", f"/api/kernels/{repo_id}/commit/main", b"".join(line + b"\n" for line in lines),
                   {"Content-Type": "application/x-ndjson"})[0]


def card_eviction(code: Path, work: Path) -> dict:
    """The 512 KiB card of `![` viewed, then 40 cards (each amplified to the per-card HTML bound) viewed once
    each, then the first card again: the server CPU seconds of its second view."""
    with server(code, work, "card-eviction") as srv:
        create_repo(srv)
        commit(srv, [HEADER, file_line("README.md", BANG_CARD)])
        first = _view(srv, f"/kernels/{REPO}")
        cpu = srv.cpu_seconds()
        for index in range(CHEAP_CARDS):
            repo_id = f"org/cheap-{index}"
            _create(srv, repo_id)
            card = (f"[r]: https://example.com/{index}/" + "x" * (32 << 10) + "\n\n").encode() + b"[a][r] " * 600
            _commit(srv, repo_id, [HEADER, file_line("README.md", card)])
            request(srv, "GET", f"/kernels/{repo_id}", token=None)
        cheap_cpu = srv.cpu_seconds() - cpu
        return {"first_view_cpu_s": first["cpu_s"], "cheap_cards": CHEAP_CARDS,
                "cheap_cards_cpu_s": round(cheap_cpu, 2),
                "view_after_cheap_cards_cpu_s": _view(srv, f"/kernels/{REPO}")["cpu_s"]}


def versions_page(code: Path, work: Path) -> dict:
    """A kernel repo of 300 version branches, each at its own commit with its own 0.9 MiB metadata.json: the
    server CPU seconds of two anonymous views of its page."""
    with server(code, work, "versions-page") as srv:
        create_repo(srv)
        files = {f"f{index}": index for index in range(60_000)}  # costly to parse per byte, under the 1 MiB bound
        for number in range(1, VERSION_BRANCHES + 1):
            metadata = json.dumps({"version": 1, "build": number, "backend": {"type": "cpu"},
                                   "digest": {"files": files}}).encode()
            commit(srv, [HEADER, file_line("build/torch-cpu/metadata.json", metadata)])
            request(srv, "POST", f"/api/kernels/{REPO}/branch/v{number}", json.dumps({"startingPoint": "main"}).encode(),
                    {"Content-Type": "application/json"})
        return {"versions": VERSION_BRANCHES, "metadata_kib": round(len(metadata) / 1024),
                "first_view": _view(srv, f"/kernels/{REPO}"), "second_view": _view(srv, f"/kernels/{REPO}")}
