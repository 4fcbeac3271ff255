"""The command line: one group's cases (or some), against the code in --code, merged into --out under a label."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import tpu_kernels
from benchmarks.studies import result_path, write_json
from benchmarks.studies.tables.hub_server import before_and_after

from .faults import (clash, commit_memory, connections, empty_token, latency, malformed, parsing, private, ref_names,
                      short_body, validate_yaml)
from .cards import card_eviction, table_card, versions_page
from .attacks import (DOT_GIT_PATHS, body_memory, card, card_page, dot_git, get_body, headers, orphans, response_memory,
                      slots, slow_body, smaller, smuggling, tree_listing)


# The folder holding the tpu_kernels package this runs from (a checkout or site-packages): the default --code.
PACKAGE_PARENT = Path(tpu_kernels.__file__).resolve().parents[1]
DEFAULT_OUT = result_path("hub_server.json")
GROUPS = {
    "faults": [empty_token, connections, short_body, parsing, validate_yaml, commit_memory, malformed, clash, ref_names,
           private, latency],
    "attacks": [slow_body, slots, body_memory, response_memory, get_body, tree_listing, dot_git, orphans, headers, smuggling, card, smaller,
           latency],
    "cards": [card_page],
    "pages": [table_card, card_eviction, versions_page],
}
# The attacks group's before/after table: (kind of attack, what is measured, case, fields of its result).
ATTACKS_TABLE = [
    ("slow clients", "body dripped at 1 B / 1.5 s, --body-timeout 2: seconds held", "slow_body", ["held_s", "outcome"]),
    ("slow clients", "8 unread 40 MiB downloads on 8 slots: seconds until a new client is served (30 s cap)", "slots",
     ["unread_downloads_free_their_slots_after_s"]),
    ("slow clients", "8 dripped bodies on 8 slots: seconds until a new client is served (30 s cap)", "slots",
     ["dripped_bodies_free_their_slots_after_s"]),
    ("slow clients", "256 connections x 4 MiB bodies: RSS growth held / peak, MiB", "body_memory",
     ["rss_growth_while_held_mib", "peak_rss_growth_mib"]),
    ("slow clients", "250 clients not reading a 40 MiB download: RSS growth after 3 s, MiB", "response_memory",
     ["rss_growth_mib"]),
    ("slow clients", "GET announcing a 4 MiB body, 1 KiB sent: answer / seconds", "get_body", ["outcome", "seconds"]),
    ("listings", "8,000 one-file folders: first page / whole recursive walk, s", "tree_listing",
     ["8000_folders.page_s", "8000_folders.recursive_walk_s"]),
    ("listings", "25,000 one-file folders: first page / whole recursive walk, s (walk stopped at 120 s)", "tree_listing",
     ["25000_folders.page_s", "25000_folders.recursive_walk_s"]),
    (".git paths", "commits of 9 spellings of .git (.GIT, a/.gIt, .git., '.git ', '.git.. ', GIT~1, git~1, .g<ZWNJ>it, "
          ".git::$INDEX_ALLOCATION): statuses", "dot_git", list(DOT_GIT_PATHS)),
    ("orphans", "lone surrogate in the summary: status / orphan blobs", "orphans",
     ["lone_surrogate_in_summary.status", "lone_surrogate_in_summary.orphan_blobs"]),
    ("orphans", "lone surrogate in a path: status / orphan blobs", "orphans",
     ["lone_surrogate_in_path.status", "lone_surrogate_in_path.orphan_blobs"]),
    ("orphans", "a path twice in one commit: status / orphan blobs", "orphans",
     ["same_path_twice.status", "same_path_twice.orphan_blobs"]),
    ("orphans", "orphan blobs before / after a restart", "orphans",
     ["restart.orphan_blobs_before", "restart.orphan_blobs_after"]),
    ("orphans", "tracebacks logged", "orphans", ["tracebacks_logged"]),
    ("headers", "40 KiB / 200 KiB header block in one write", "headers", ["40_kib_in_one_write", "200_kib_in_one_write"]),
    ("smuggling", "Content-Length + Transfer-Encoding, a GET pipelined behind: statuses / closed", "smuggling",
     ["statuses", "closed"]),
    ("cards", "512 KiB card of `![`: server CPU s, first GET / second GET / HEAD", "card",
     ["first_get_cpu_s", "second_get_cpu_s", "head_cpu_s"]),
    ("names and hosts", "Host: evil.example / 127.0.0.1 / localhost", "smaller",
     ["host_evil_example", "host_127_0_0_1", "host_localhost"]),
    ("names and hosts", "names with an RTL override / DEL / NEL; NFC+NFD twins; case twins: statuses", "smaller",
     ["rtl_override", "control_char", "c1_control", "nfc_nfd_twins", "case_twins"]),
    ("names and hosts", "HEAD on whoami", "smaller", ["head_whoami"]),
    ("latency", "1000 GETs of /refs kept alive: median / p99 ms; 64 MiB download MiB/s", "latency",
     ["refs_get_median_ms", "refs_get_p99_ms", "download_64_mib_mib_per_s"]),
]


def attacks_table(group: dict) -> list[list[str]]:
    """[kind of attack, measure, before, after] rows from the two runs' results."""
    return [[kind, measure, *before_and_after(group, case, fields)] for kind, measure, case, fields in ATTACKS_TABLE]


def run_group(code: Path, cases) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="hub-bench-") as folder:
        for case in cases:
            print(f"{code.name}: {case.__name__} ...", flush=True)
            results[case.__name__] = case(code, Path(folder))
            print(f"  {json.dumps(results[case.__name__])}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    what = sys.modules[__package__].__doc__.split("\n")[0]
    parser = argparse.ArgumentParser(description=what)
    parser.add_argument("--group", choices=sorted(GROUPS), default="attacks", help="which group of cases to run")
    parser.add_argument("--case", action="append", help="run only these cases (by name)")
    parser.add_argument("--code", type=Path, default=PACKAGE_PARENT,
                        help="folder holding the tpu_kernels package to measure (default: this one's)")
    parser.add_argument("--label", default="after", help="where the results go: before or after")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    cases = [case for case in GROUPS[args.group] if not args.case or case.__name__ in args.case]
    report = json.loads(args.out.read_text()) if args.out.is_file() else {"what": what}
    group = report.setdefault(args.group, {})
    group.setdefault(args.label, {}).update(run_group(args.code.resolve(), cases))
    group.setdefault("machine", {})[args.label] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                                                   "load_average_at_start": [round(x, 1) for x in os.getloadavg()]}
    if args.group == "attacks" and {"before", "after"} <= set(group):
        group["table"] = attacks_table(group)
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0
