"""The local Hub server under hostile input and faults, measured.

Each case runs against `python -m tpu_kernels.distribution.hub` in its own process on loopback,
with the server's default limits as deployed, unless the case names a flag.

Faults (`--group faults`):

    empty_token      TPU_KERNELS_HUB_TOKEN= : the banner's access line; an anonymous repo creation
    connections      620 connections (half idle, half with half-sent headers): open after 15 s,
                     server threads; a GET meanwhile (503 beyond the connection cap) and after
    short_body       Content-Length 100 with a 10-byte body: seconds until answered (40 s cap)
    parsing          malformed and conflicting Content-Length: status, or "dropped"; tracebacks logged
    validate_yaml    anonymous 0.4 MB README: status, server CPU seconds, peak RSS growth
    commit_memory    one-file commits of 64 and 256 MiB: server peak RSS (VmHWM) growth over an
                     8 MiB warm-up commit, upload rate
    malformed        malformed commit lines and a huge cursor: statuses
    clash            one commit adding `c` and `c/d`: status; does a snapshot hold every file of the branch
    ref_names        branches `a/./b`, `a/.hidden`: statuses
    private          create_repo(private=True), then an anonymous repo_info: status
    latency          1000 GETs of /refs on one kept-alive connection: median and p99 ms;
                     a 64 MiB download: MiB/s

Attacks (`--group attacks`, the default):

    slow_body        an anonymous body dripped at 1 byte per 1.5 s, --body-timeout 2: seconds
                     until the server cuts it (30 s cap)
    slots            --max-connections 8: 8 clients that never read a 40 MiB download, then 8
                     that drip bodies; seconds until a new client is served again (30 s cap each)
    body_memory      256 connections each sending a 4 MiB anonymous body (all but its last byte,
                     then the rest): server RSS growth while held, peak growth after
    response_memory  250 clients that never read a 40 MiB download: server RSS growth after 3 s
    get_body         a GET announcing a 4 MiB body and sending 1 KiB, --body-timeout 2: status,
                     seconds until answered
    tree_listing     8,000 and 25,000 one-file folders: seconds for the first page of the
                     listing and of the recursive listing, and for the whole recursive walk (as
                     snapshot_download does; stopped after 120 s)
    dot_git          commits of paths that are `.git` on some file system: statuses
    orphans          lone surrogates, a path given twice: statuses, blobs no commit references;
                     the same after a restart with one more planted orphan
    headers          a 40 KiB and a 200 KiB header block, each in one write: status
    smuggling        Content-Length with Transfer-Encoding, a request pipelined behind:
                     answers, connection closed or not
    card             a 512 KiB card of `![`: server CPU seconds for two GETs of the page, a HEAD
    smaller          Host: evil.example (DNS rebinding); RTL-override, control-character, NFC/NFD
                     and case-twin names; HEAD on whoami: statuses
    latency          as above: what the new bounds cost a well-behaved client

Cards (`--group cards`):

    card_page        a 79 KB card of one 50 KiB reference link used 4,000 times: its page's bytes, the
                     server's RSS after one view and with 8 more clients that never read the page

Pages (`--group pages`; "before" is the code before issue 64's bounds):

    table_card       a 23 KB card of 16 tables that markdown-it fills in (3.2M tokens): server CPU
                     seconds and peak RSS growth of two views of its page
    card_eviction    a 512 KiB card of `![` viewed, then 40 cards amplified to the per-card bound
                     viewed once each: server CPU seconds of the first card's next view
    versions_page    300 version branches, each at its own commit with its own 0.9 MiB
                     metadata.json: server CPU seconds of two views of the repo page

`--code DIR --label before` runs a group against the package in DIR (e.g. an export of
another commit: `git archive <commit> tpu_kernels | tar -x -C DIR`; by default the folder
holding the tpu_kernels package this runs from); results merge into
benchmarks/results/hub_server.json (relative to the current directory; `--out`) under the
group and the label.

Usage:
    python -m benchmarks hub_server [--group attacks|faults|cards|pages] [--code DIR --label before]
    (or python -m benchmarks.studies.hub_server ...)
Modules: `client` (the server process, raw and HTTP clients), `faults`, `attacks` and
`cards` (the cases), `run` (the command line and the attacks' before/after table).
"""

from .run import DEFAULT_OUT, main

__all__ = ["DEFAULT_OUT", "main"]
