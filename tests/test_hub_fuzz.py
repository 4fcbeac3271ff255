"""A bounded fuzz run (hypothesis) of the local Hub's path rules and commit reader.

Whatever a client sends, the answer is never a 500, the log holds no error (a traceback is
one), nothing stays staged, and no blob is left that no commit references. About 30 s in
all on a 2-core machine; a failure prints the blob that replays it (@reproduce_failure).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import unicodedata
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tpu_kernels.distribution.hub import Limits, start_hub
from tpu_kernels.distribution.hub.errors import HubError
from tpu_kernels.distribution.hub.names import name_key, validate_path

from .test_hub_hardening import http

TOKEN = "fuzz-" + os.urandom(4).hex()
REPO = "org/fuzzed"
ANSWERS = {200, 400, 404, 409, 412, 413}

# Names a file system, git or a terminal treats specially, and their near misses.
SPECIAL_PARTS = [
    ".git", ".GIT", ".gIt", ".git.", ".git ", ".git. .", "GIT~1", "git~2", ".git::$INDEX_ALLOCATION", ".git:x",
    ".g\u200cit", ".g\u0131t", ".github", ".gitignore", "git", "a.git", "..", ".", "", "a", "A", "a.", "a ",
    "caf\u00e9", "cafe\u0301", "README.md", "readme.md", "x\u202ey", "\u2066z", "\ufeff", "\ud800", "\udfff",
    "\x00", "\x1b[31m", "\x7f", "a\\b", "con", "a:b", "~", "\u00df", "SS",
]
PARTS = st.one_of(st.sampled_from(SPECIAL_PARTS), st.text(alphabet="abAB._- ~", min_size=1, max_size=6),
                  st.text(alphabet=st.characters(exclude_categories=()), max_size=10))
PATHS = st.lists(PARTS, min_size=1, max_size=4).map("/".join)
REFUSED_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}


def _file_system_spellings(part: str) -> set[str]:
    """How file systems may read a name: Windows drops trailing dots and spaces and reads `name:x`
    as a stream of `name`; Windows and macOS fold case (NTFS by upper-casing)."""
    stripped = part.split(":", 1)[0].rstrip(". ")
    return {form for name in (part, stripped) for form in (name.upper(), name.casefold(), name.lower())}


@settings(max_examples=3000, deadline=None, database=None)
@given(PATHS)
def test_an_accepted_path_is_never_git_nor_invisible_nor_escaping(path):
    try:
        accepted = validate_path(path)
    except HubError as error:
        assert error.status == 400 and error.message.encode()
        return
    assert accepted == path
    parts = path.split("/")
    assert "" not in parts and "." not in parts and ".." not in parts and "\\" not in path
    assert not {unicodedata.category(char) for char in path} & REFUSED_CATEGORIES
    for part in parts:
        spellings = _file_system_spellings(part)
        assert ".git" not in spellings and ".GIT" not in spellings
        assert not any(spelling.upper().startswith("GIT~") and spelling[4:].isdigit() for spelling in spellings)
    name_key(path).encode()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    limits = Limits(header_timeout=2, idle_timeout=2, body_timeout=2, send_timeout=2)
    with start_hub(tmp_path_factory.mktemp("fuzz") / "hub", token=TOKEN, limits=limits) as running:
        status, _, _ = http("POST", f"{running.url}/api/repos/create", token=TOKEN,
                            body=json.dumps({"name": REPO.split("/")[1], "organization": "org", "type": "kernel"}).encode())
        assert status == 200
        yield running


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def errors():
    handler = _Errors()
    logging.getLogger().addHandler(handler)
    yield handler.records
    logging.getLogger().removeHandler(handler)


TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=20)
OPERATIONS = st.one_of(
    st.tuples(st.just("file"), PATHS, st.binary(max_size=40)),
    st.tuples(st.sampled_from(["deletedFile", "deletedFolder"]), PATHS),
    st.tuples(st.just("raw"), st.one_of(
        st.binary(max_size=30),
        st.recursive(st.none() | st.booleans() | st.integers() | TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                     max_leaves=6).map(lambda value: json.dumps(value).encode()))),
)


def _line(operation) -> bytes:
    kind, *rest = operation
    if kind == "raw":
        return rest[0]
    if kind == "file":
        path, content = rest
        return json.dumps({"key": "file", "value": {"path": path, "content": base64.b64encode(content).decode(),
                                                    "encoding": "base64"}}).encode()
    return json.dumps({"key": kind, "value": {"path": rest[0]}}).encode()


def _unreferenced_blobs(root: Path) -> list[str]:
    referenced = {entry["sha256"] for commit_file in root.glob("repos/*/*/*/commits/*.json")
                  for entry in json.loads(commit_file.read_bytes())["files"].values()}
    return [blob.name for blob in root.glob("blobs/*/*") if blob.name not in referenced]


@pytest.mark.slow
@settings(max_examples=1200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(summary=TEXT, description=st.none() | TEXT, operations=st.lists(OPERATIONS, max_size=5),
       cut=st.none() | st.integers(min_value=0, max_value=400), probe=PATHS)
def test_no_commit_body_gets_a_500_an_error_log_or_leaves_a_blob_behind(hub, errors, summary, description,
                                                                         operations, cut, probe):
    header = {"key": "header", "value": {"summary": summary, **({"description": description} if description else {})}}
    body = b"\n".join([json.dumps(header).encode(), *map(_line, operations)]) + b"\n"
    if cut is not None:
        body = body[:cut]
    status, _, answer = http("POST", f"{hub.url}/api/kernels/{REPO}/commit/main", body, token=TOKEN,
                             headers={"Content-Type": "application/x-ndjson"})
    assert status in ANSWERS, answer[:500]
    event(f"commit answered {status}")
    for url in (f"{hub.url}/kernels/{REPO}/resolve/main/{quote(probe, safe='/', errors='surrogatepass')}",
                f"{hub.url}/api/kernels/{REPO}/tree/main/{quote(probe, safe='/', errors='surrogatepass')}"):
        assert http("GET", url)[0] in ANSWERS
    assert errors == []
    root = hub.storage.root
    assert not any((root / "tmp").iterdir())
    assert _unreferenced_blobs(root) == []
