"""The NDJSON body of a commit request, parsed while it arrives.

huggingface_hub sends one JSON object per line:

    {"key": "header", "value": {"summary": ..., "description": ..., "parentCommit": ...}}
    {"key": "file", "value": {"content": <base64>, "path": ..., "encoding": "base64"}}
    {"key": "deletedFile" | "deletedFolder", "value": {"path": ...}}

A file's base64 `content` can be hundreds of MiB in one JSON string. json.loads
would hold it several times over (the line, the string, the decoded bytes), so
this reader tokenizes each line itself and decodes `value.content` straight into
a staging file piece by piece: memory stays at one network chunk whatever the
file's size. Every other string is capped, and a malformed shape is a 400 naming
the line and the field.
"""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from .blobs import BlobStore, FileEntry, StagedFile, StagingWriter
from .commits import Deletion
from .errors import HubError
from .names import validate_path

# Bounds on everything in a line but a file's content: strings (summary, description,
# path), values per line and nesting. huggingface_hub's lines hold 3 to 6 values.
MAX_LINE_BYTES = 1 << 20
MAX_VALUES_PER_LINE = 256
MAX_DEPTH = 8
MAX_SCALAR_BYTES = 64
MAX_OPERATIONS = 25_000

_CONTENT_FIELD = "value.content"
_SCALAR_BYTES = frozenset(b"-+.0123456789eEtruefalsn")
# Whitespace inside a line, and between lines.
_PAST_LINE_SPACE = re.compile(rb"[^ \t\r]")
_PAST_SPACE = re.compile(rb"[^ \t\r\n]")
_BASE64_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")
_PARENT_COMMIT = re.compile(r"[0-9a-fA-F]{5,40}")
_FORMAT = 'expected NDJSON lines {"key": ..., "value": {...}}, the header first'


@dataclass
class CommitPayload:
    summary: str
    description: str
    parent_commit: str | None
    additions: list[StagedFile]
    deletions: list[Deletion]


class _Base64ToFile:
    """Decodes base64 text arriving in arbitrary pieces, strictly (alphabet, padding only at the end)."""

    def __init__(self, writer: StagingWriter):
        self._writer = writer
        self._pending = bytearray()
        self._padded = False

    def feed(self, text) -> None:
        self._pending += text
        whole = len(self._pending) - len(self._pending) % 4
        if whole:
            self._decode(self._pending[:whole])
            del self._pending[:whole]

    def finish(self) -> FileEntry:
        if self._pending:
            raise binascii.Error("its length is not a multiple of 4 (missing padding?)")
        return self._writer.finish()

    def _decode(self, text: bytearray) -> None:
        if self._padded:
            raise binascii.Error("data after the padding")
        self._writer.write(binascii.a2b_base64(text, strict_mode=True))
        self._padded = text.endswith(b"=")


class _LineReader:
    """JSON values, one per line, from a byte source that may split them anywhere."""

    def __init__(self, read_chunk: Callable[[], bytes], blob_store: BlobStore):
        self._read_chunk = read_chunk
        self._blob_store = blob_store
        self._buffer = b""
        self._position = 0
        self._ended = False
        self.line = 0
        self._budget = 0
        self._values = 0
        self._writers: list[StagingWriter] = []

    def error(self, field: str, problem: str) -> HubError:
        where = f"line {self.line}" + (f", {field}" if field else "")
        return HubError(400, f"Invalid commit payload ({where}): {problem}")

    # -- bytes ----------------------------------------------------------------------------------

    def _available(self) -> bool:
        """Whether an unread byte is buffered, reading the next chunk if needed."""
        while self._position >= len(self._buffer):
            if self._ended:
                return False
            chunk = self._read_chunk()
            if not chunk:
                self._ended = True
                return False
            self._buffer, self._position = chunk, 0
        return True

    def _peek(self) -> int | None:
        return self._buffer[self._position] if self._available() else None

    def _take(self, field: str, count: int) -> bytes:
        taken = bytearray()
        while len(taken) < count:
            if not self._available():
                raise self.error(field, "the body ends inside a string")
            piece = self._buffer[self._position:self._position + count - len(taken)]
            taken += piece
            self._position += len(piece)
        return bytes(taken)

    def _skip(self, not_space: re.Pattern) -> None:
        while self._available():
            found = not_space.search(self._buffer, self._position)
            if found:
                self._position = found.start()
                return
            self._position = len(self._buffer)

    def _spend(self, field: str, count: int) -> None:
        self._budget -= count
        if self._budget < 0:
            raise self.error(field, f"the line, without file contents, is larger than {MAX_LINE_BYTES} bytes")

    # -- lines ----------------------------------------------------------------------------------

    def next_line(self):
        """The next line's JSON value, or None at the end of the body."""
        self._skip(_PAST_SPACE)
        if self._peek() is None:
            return None
        self.line += 1
        self._budget, self._values = MAX_LINE_BYTES, 0
        value = self._value("", 0)
        self._skip(_PAST_LINE_SPACE)
        if self._peek() not in (None, ord("\n")):
            raise self.error("", "more than one JSON value on the line")
        return value

    def claim(self, content: StagingWriter) -> None:
        """The staged content now belongs to the caller: no longer removed on an error."""
        self._writers.remove(content)

    def discard_unclaimed(self) -> None:
        for writer in self._writers:
            writer.abort()
        self._writers.clear()

    # -- values ---------------------------------------------------------------------------------

    def _value(self, field: str, depth: int):
        self._values += 1
        if self._values > MAX_VALUES_PER_LINE:
            raise self.error(field, f"more than {MAX_VALUES_PER_LINE} JSON values on one line")
        if depth > MAX_DEPTH:
            raise self.error(field, f"nested deeper than {MAX_DEPTH} levels")
        self._skip(_PAST_LINE_SPACE)
        byte = self._peek()
        if byte is None or byte == ord("\n"):
            raise self.error(field, "the line ends where a value should start")
        if byte == ord("{"):
            return self._object(field, depth)
        if byte == ord("["):
            return self._array(field, depth)
        if byte == ord('"'):
            return self._content(field) if field == _CONTENT_FIELD else self._string(field)
        return self._scalar(field)

    def _members(self, field: str, closing: int):
        """Yields once per member of an object or array; consumes the separators and the closing bracket."""
        self._position += 1
        self._skip(_PAST_LINE_SPACE)
        if self._peek() == closing:
            self._position += 1
            return
        while True:
            yield
            self._skip(_PAST_LINE_SPACE)
            byte = self._peek()
            self._position += 1
            if byte == closing:
                return
            if byte != ord(","):
                raise self.error(field, f"expected ',' or {chr(closing)!r}")

    def _object(self, field: str, depth: int) -> dict:
        result = {}
        for _ in self._members(field, ord("}")):
            self._skip(_PAST_LINE_SPACE)
            if self._peek() != ord('"'):
                raise self.error(field, "expected a quoted field name")
            key = self._string(field)
            child = f"{field}.{key}" if field else key
            if key in result:
                raise self.error(child, "given twice")
            self._skip(_PAST_LINE_SPACE)
            if self._peek() != ord(":"):
                raise self.error(child, "expected ':' after the field name")
            self._position += 1
            result[key] = self._value(child, depth + 1)
        return result

    def _array(self, field: str, depth: int) -> list:
        result = []
        for _ in self._members(field, ord("]")):
            result.append(self._value(f"{field}[{len(result)}]", depth + 1))
        return result

    def _scalar(self, field: str):
        token = bytearray()
        while (byte := self._peek()) is not None and byte in _SCALAR_BYTES:
            token.append(byte)
            self._position += 1
            if len(token) > MAX_SCALAR_BYTES:
                raise self.error(field, f"a number or literal longer than {MAX_SCALAR_BYTES} characters")
        try:
            return json.loads(token)
        except ValueError:
            raise self.error(field, "not a JSON value") from None

    def _string_pieces(self, field: str):
        """The raw bytes of a JSON string after its opening quote, in pieces, escapes as one piece each."""
        self._position += 1
        while True:
            if not self._available():
                raise self.error(field, "the body ends inside a string")
            # bytes.find is memchr; a regex character class scans ~20x slower. The backslash search
            # stops at the quote, so each byte of the line is scanned a bounded number of times.
            quote = self._buffer.find(b'"', self._position)
            backslash = self._buffer.find(b"\\", self._position, len(self._buffer) if quote < 0 else quote)
            end = backslash if backslash >= 0 else quote if quote >= 0 else len(self._buffer)
            if end > self._position:
                yield memoryview(self._buffer)[self._position:end]
                self._position = end
            if end == len(self._buffer):
                continue
            self._position += 1
            if end == quote:
                return
            escape = self._take(field, 1)
            yield b"\\" + escape + (self._take(field, 4) if escape == b"u" else b"")

    def _string(self, field: str) -> str:
        raw = bytearray(b'"')
        for piece in self._string_pieces(field):
            self._spend(field, len(piece))
            raw += piece
        raw += b'"'
        try:
            value = json.loads(raw)
            # json.loads lets a lone surrogate through, escaped (\ud800) or UTF-8-encoded.
            value.encode("utf-8")
        except UnicodeError:
            raise self.error(field, "not valid Unicode (invalid UTF-8, or a lone surrogate)") from None
        except ValueError as error:
            raise self.error(field, f"not a valid JSON string ({error.msg})") from None
        return value

    def _content(self, field: str) -> StagingWriter:
        writer = self._blob_store.start_staging()
        self._writers.append(writer)
        decoder = _Base64ToFile(writer)
        try:
            for piece in self._string_pieces(field):
                if piece[:1] == b"\\":
                    # JSON may escape any character, e.g. '/' as `\/`: decode it, then it must be base64.
                    try:
                        piece = json.loads(b'"' + piece + b'"')
                    except ValueError:
                        raise self.error(field, "invalid escape in the base64 string") from None
                    if piece not in _BASE64_ALPHABET:
                        raise binascii.Error(f"{piece!r} is not a base64 character")
                    piece = piece.encode()
                decoder.feed(piece)
            decoder.finish()
            return writer
        except binascii.Error as error:
            raise self.error(field, f"invalid base64 ({error})") from None


def read_commit_payload(read_chunk: Callable[[], bytes], blob_store: BlobStore) -> CommitPayload:
    """Parse a commit body from `read_chunk()` (b"" at its end); added files are staged in `blob_store`.

    On any error, everything staged is removed before the error propagates.
    """
    reader = _LineReader(read_chunk, blob_store)
    header: dict | None = None
    additions: list[StagedFile] = []
    added_paths: set[str] = set()
    deletions: list[Deletion] = []
    try:
        while (line := reader.next_line()) is not None:
            if reader.line > MAX_OPERATIONS + 1:
                raise reader.error("", f"more than {MAX_OPERATIONS} operations in one commit")
            key, value = _operation(reader, line)
            content = value.get("content")
            if key != "file" and content is not None:
                raise reader.error(_CONTENT_FIELD, f"only 'file' operations carry content, not {key!r}")
            if key == "header":
                if header is not None or reader.line != 1:
                    raise reader.error("key", f"the header comes once, first ({_FORMAT})")
                header = value
            elif reader.line == 1:
                raise reader.error("key", f"the first line must be the header ({_FORMAT})")
            elif key == "file":
                path = _path(reader, value)
                if value.get("encoding", "base64") != "base64":
                    raise reader.error("value.encoding", "only 'base64' is supported")
                if not isinstance(content, StagingWriter):
                    raise reader.error(_CONTENT_FIELD, "expected the file's content as a base64 string")
                if path in added_paths:
                    raise reader.error("value.path", f"{path!r} is added twice in this commit")
                added_paths.add(path)
                reader.claim(content)
                additions.append(content.staged_as(path))
            elif key in ("deletedFile", "deletedFolder"):
                deletions.append(Deletion(_path(reader, value, folder=key == "deletedFolder"), key == "deletedFolder"))
            elif key == "lfsFile":
                raise reader.error("key", "this server does not store LFS files (preupload never asks for LFS)")
            else:
                raise reader.error("key", f"unknown operation {key[:64]!r}")
        if header is None:
            raise HubError(400, f"Invalid commit payload: empty body ({_FORMAT})")
        return CommitPayload(
            summary=_summary(header),
            description=_optional_string(header, "description") or "",
            parent_commit=_parent_commit(header),
            additions=additions,
            deletions=deletions,
        )
    except BaseException:
        reader.discard_unclaimed()
        blob_store.discard(additions)
        raise


def _operation(reader: _LineReader, line) -> tuple[str, dict]:
    if not isinstance(line, dict):
        raise reader.error("", f"not a JSON object ({_FORMAT})")
    key, value = line.get("key"), line.get("value")
    if not isinstance(key, str):
        raise reader.error("key", "expected a string")
    if not isinstance(value, dict):
        raise reader.error("value", "expected an object")
    return key, value


def _path(reader: _LineReader, value: dict, folder: bool = False) -> str:
    path = value.get("path")
    if not isinstance(path, str):
        raise reader.error("value.path", "expected a string")
    try:
        return validate_path(path.rstrip("/") if folder else path)
    except HubError as error:
        raise reader.error("value.path", error.message) from None


def _summary(header: dict) -> str:
    summary = header.get("summary")
    if not isinstance(summary, str) or not summary.strip():
        raise HubError(400, "Invalid commit payload (line 1, value.summary): expected a non-empty string")
    return summary


def _optional_string(header: dict, name: str) -> str | None:
    value = header.get(name)
    if value is not None and not isinstance(value, str):
        raise HubError(400, f"Invalid commit payload (line 1, value.{name}): expected a string")
    return value


def _parent_commit(header: dict) -> str | None:
    parent = _optional_string(header, "parentCommit")
    if parent is not None and not _PARENT_COMMIT.fullmatch(parent):
        raise HubError(400, f"Invalid commit payload (line 1, value.parentCommit): {parent[:64]!r} is not a commit id")
    return parent
