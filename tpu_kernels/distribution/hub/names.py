"""What a repo type, repo id, file path and branch or tag name may be, as the Hub and file systems allow."""

from __future__ import annotations

import re
import unicodedata

from .errors import NOT_SUPPORTED, HubError

REPO_TYPES = ("model", "kernel")
MAIN_BRANCH = "main"
# URL prefixes and API words that would make a namespace ambiguous in routes.
RESERVED_NAMESPACES = frozenset({"api", "models", "kernels", "datasets", "spaces", "buckets", "resolve", "tmp"})
MAX_PATH_CHARS = 1024
MAX_REF_CHARS = 255
# A revision: a branch or tag name, `refs/heads/` or `refs/tags/` and one, or a commit id.
MAX_REVISION_CHARS = MAX_REF_CHARS + len("refs/heads/")

_REPO_NAME_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_REF_CHARS = re.compile(r"[A-Za-z0-9._/-]+")
COMMIT_ID = re.compile(r"[0-9a-f]{40}")
# Control, format (bidi overrides, zero-width joiners, the code points HFS+ ignores in names),
# surrogate and line/paragraph separator characters: none belongs in a file name.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# The 8.3 short names Windows gives `.git` (GIT~1, or GIT~2... when names collide).
_GIT_SHORT_NAME = re.compile(r"GIT~[0-9]+")
# The form of an 8.3 short name NTFS gives a long name (CONFIG~1.JSO for config.json; after four
# collisions a hash, CO1A2B~1.JSO): at most 8 characters ending in ~ and digits, and an extension
# of at most 3. Opened on NTFS, such a name may be another file of the folder.
_SHORT_NAME = re.compile(r"(?=[^.]{1,8}(?:\.|$))[^.]*~[0-9]+(?:\.[^.]{1,3})?")


def validate_repo_type(repo_type: str) -> str:
    if repo_type not in REPO_TYPES:
        raise HubError(400, f"{NOT_SUPPORTED}: {str(repo_type)[:40]!r} repos: this server holds kernel and model repos only")
    return repo_type


def validate_repo_id(repo_id: str) -> tuple[str, str]:
    """`namespace/name` with the Hub's character rules; returns both parts."""
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_NAME_PART.fullmatch(part) for part in parts):
        raise HubError(
            400,
            f"Invalid repo id {repo_id!r}: expected 'namespace/name' made of letters, digits, '-', '_' and '.', "
            "each part starting and ending with a letter or digit, at most 96 characters",
        )
    if any("--" in part or ".." in part for part in parts):
        raise HubError(400, f"Invalid repo id {repo_id!r}: '--' and '..' are not allowed")
    if parts[0].lower() in RESERVED_NAMESPACES:
        raise HubError(400, f"Invalid repo id {repo_id!r}: namespace {parts[0]!r} is reserved")
    return parts[0], parts[1]


def validate_path(path: str) -> str:
    """A file path inside a repo: relative, normalised, never escaping the repo root, and safe to
    write into a local folder on any file system a client may use.

    Refused: control, format (bidi, zero-width), surrogate and line-separator characters; any
    part that git, or a file system folding case, dropping trailing dots and spaces or reading
    `name:stream` as a stream of `name`, would take for `.git` (`.GIT`, `.git.`, `.git `,
    `.git::$INDEX_ALLOCATION`, and the 8.3 short name `GIT~1`); and NTFS's other aliases of a
    file: any `:` (`README.md::$DATA`, `README.md:$DATA` and `config.json:evil` are streams of
    the file before the colon) and any part of the form of an 8.3 short name (`CONFIG~1.JSO` is
    config.json), whatever the folder holds.
    """
    _check_visible_text("path", path, MAX_PATH_CHARS)
    if "\\" in path:
        raise HubError(400, f"Invalid path {path!r}: use '/' as the separator")
    if path.startswith("/"):
        raise HubError(400, f"Invalid path {path!r}: absolute paths are not allowed")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise HubError(400, f"Invalid path {path!r}: empty, '.' and '..' segments are not allowed")
    if any(_is_git_folder_alias(part) for part in parts):
        raise HubError(400, f"Invalid path {path!r}: '.git' folders are not allowed, in any case or spelling "
                            "a file system would read as '.git'")
    if ":" in path:
        raise HubError(400, f"Invalid path {path!r}: ':' is not allowed (on NTFS, 'name:stream' and "
                            "'name::$DATA' are streams of the file 'name')")
    short = next((part for part in parts if _SHORT_NAME.fullmatch(part.rstrip(". "))), None)
    if short is not None:
        raise HubError(400, f"Invalid path {path!r}: {short!r} has the form of a Windows 8.3 short name "
                            "(like CONFIG~1.JSO), which NTFS may read as another file of its folder")
    return path


def _is_git_folder_alias(part: str) -> bool:
    name = part.split(":", 1)[0].rstrip(". ")
    return name.upper() == ".GIT" or name.casefold() == ".git" or bool(_GIT_SHORT_NAME.fullmatch(name.upper()))


def name_key(path: str) -> str:
    """What a path is to a file system that folds case and Unicode normalisation and drops each
    name's trailing dots and spaces: two paths with one key land on one file there."""
    return "/".join(
        unicodedata.normalize("NFD", unicodedata.normalize("NFD", part.rstrip(". ")).upper().casefold())
        for part in path.split("/")
    )


def validate_revision(revision: str) -> str:
    """A revision as a request gives it (a branch, tag, full ref name or commit id, checked against the
    repo later): 400 if empty, too long, or holding a control or invisible character, which no branch,
    tag or commit id has (a NUL would otherwise reach the error's header)."""
    _check_visible_text("revision", revision, MAX_REVISION_CHARS)
    return revision


def _check_visible_text(what: str, value: str, max_chars: int) -> None:
    """400 unless `value`, a request's `what` ("path", "revision"), is a non-empty string of at most `max_chars`
    characters, none of them a control or invisible one."""
    if not isinstance(value, str) or not value:
        raise HubError(400, f"Invalid {what}: empty")
    if len(value) > max_chars:
        raise HubError(400, f"Invalid {what} {value[:80]!r}...: longer than {max_chars} characters")
    refused = next((char for char in value if unicodedata.category(char) in _REFUSED_CATEGORIES), None)
    if refused is not None:
        raise HubError(400, f"Invalid {what} {value!r}: control, bidi, zero-width and other invisible characters "
                            f"are not allowed (U+{ord(refused):04X})")


def validate_ref_name(name: str) -> str:
    """A branch or tag name: git's check-ref-format rules on a conservative character set.

    Letters, digits, '.', '_', '-' and '/' only (so none of git's forbidden characters
    `~^:?*[\\`, spaces, control characters or `@{`), starting with a letter or digit; no
    empty, '.'-leading or '.lock'-ending component; no '..'; no trailing '.' or '/'. Also
    refused: names that read as a commit id or a full ref (`refs/...`), and `HEAD`.
    """
    if not isinstance(name, str) or not name:
        raise HubError(400, "Invalid branch or tag name: empty")
    problem = None
    components = name.split("/")
    if len(name) > MAX_REF_CHARS:
        problem = f"longer than {MAX_REF_CHARS} characters"
    elif not _REF_CHARS.fullmatch(name):
        problem = "only letters, digits, '.', '_', '-' and '/' are allowed"
    elif not name[0].isalnum():
        problem = "it must start with a letter or digit"
    elif any(not component for component in components):
        problem = "empty component ('//' or a trailing '/')"
    elif any(component.startswith(".") for component in components):
        problem = "a component starts with '.'"
    elif any(component.endswith(".lock") for component in components):
        problem = "a component ends with '.lock'"
    elif ".." in name:
        problem = "'..' is not allowed"
    elif name.endswith("."):
        problem = "it ends with '.'"
    elif COMMIT_ID.fullmatch(name):
        problem = "it reads as a commit id"
    elif components[0] == "refs" or name == "HEAD":
        problem = "'HEAD' and names under 'refs/' are reserved"
    if problem:
        raise HubError(400, f"Invalid branch or tag name {name!r}: {problem}")
    return name


def split_full_ref(revision: str) -> tuple[str | None, str]:
    """("branches", name) for `refs/heads/<name>`, ("tags", name) for `refs/tags/<name>`, else (None, revision)."""
    for prefix, kind in (("refs/heads/", "branches"), ("refs/tags/", "tags")):
        if revision.startswith(prefix) and len(revision) > len(prefix):
            return kind, revision[len(prefix):]
    return None, revision


def branch_name(revision: str) -> str:
    """The branch a commit targets: `refs/heads/<name>` is `<name>`, as on the Hub."""
    kind, name = split_full_ref(revision)
    return name if kind == "branches" else revision
