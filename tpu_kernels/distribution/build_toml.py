"""build.toml of a kernel repo: the part of kernel-builder's edition 6 format that `tpu-kernels build` builds.

kernels 0.19 reads build.toml edition 6 (its parser upgrades an edition 5 file in memory, with a
warning on every build). Its parser is not part of its public API, so the file is read here with
tomllib and checked against what the builder supports:

    [general]
    edition = 6                      # required, exactly 6
    name = "rmsnorm-tpu"             # required: lowercase letters, digits and dashes (kernels' KernelName)
    version = 1                      # required: the major version, published on branch v<version>
    license = "apache-2.0"           # required
    backends = ["tpu", "cpu"]        # required: one or more of SUPPORTED_BACKENDS, one variant each

    [general.hub]                    # optional
    repo-id = "tpu-kernels/rmsnorm-tpu"

    [torch-noarch]                   # required and empty: the builds are noarch torch variants

Every other key is refused, keys kernel-builder knows included (`upstream`, `python-depends`,
`kernel-depends`, `[general.cuda]`, `pyext`, ...): this builder would silently ignore them.

Standard library only.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

EDITION = 6
SUPPORTED_BACKENDS = ("cpu", "tpu")
# kernels' KernelName: `^[a-z][-a-z0-9]*[a-z0-9]$`.
_KERNEL_NAME = re.compile(r"[a-z][-a-z0-9]*[a-z0-9]")
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_TABLES = ("general", "torch-noarch")
_GENERAL_KEYS = ("edition", "name", "version", "license", "backends", "hub")
_REQUIRED_GENERAL_KEYS = ("edition", "name", "version", "license", "backends")
_HUB_KEYS = ("repo-id",)


class BuildTomlError(ValueError):
    """build.toml is not valid, or asks for something `tpu-kernels build` does not build."""


@dataclass(frozen=True)
class BuildToml:
    """The fields of a valid build.toml."""

    name: str
    version: int
    license: str
    backends: tuple[str, ...]
    repo_id: str | None


def read_build_toml(path: Path) -> BuildToml:
    """Parse and check the build.toml at `path`; BuildTomlError says what to change."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise BuildTomlError(f"{path}: not valid TOML: {error}") from None
    except RecursionError:
        raise BuildTomlError(f"{path}: nests too deeply to parse") from None

    def fail(message: str) -> BuildTomlError:
        return BuildTomlError(f"{path}: {message}")

    _refuse_unknown(document, _TABLES, "top-level table", fail)
    general = document.get("general")
    if not isinstance(general, dict):
        raise fail("no [general] table")
    _check_edition(general, fail)
    missing = [key for key in _REQUIRED_GENERAL_KEYS if key not in general]
    if missing:
        raise fail(f"[general] lacks {', '.join(f'`{key}`' for key in missing)} (required: "
                   f"{', '.join(_REQUIRED_GENERAL_KEYS)})")
    _refuse_unknown(general, _GENERAL_KEYS, "key in [general]", fail)

    name = general["name"]
    if not isinstance(name, str) or not _KERNEL_NAME.fullmatch(name):
        raise fail(f"name {name!r} is not a kernel name (lowercase letters, digits and dashes, starting with a "
                   "letter and not ending with a dash, e.g. `rmsnorm-tpu`)")
    version = general["version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise fail(f"version {version!r} is not a non-negative integer (the major version: branch v<version>)")
    license_ = general["license"]
    if not isinstance(license_, str) or not license_:
        raise fail(f"license {license_!r} is not a license name (e.g. \"apache-2.0\")")
    backends = general["backends"]
    if not isinstance(backends, list) or not backends or not all(isinstance(item, str) for item in backends):
        raise fail(f"backends {backends!r} is not a non-empty list of backend names")
    unsupported = [item for item in backends if item not in SUPPORTED_BACKENDS]
    if unsupported:
        raise fail(f"backends {', '.join(map(repr, unsupported))} not supported: tpu-kernels builds "
                   f"{' and '.join(SUPPORTED_BACKENDS)} (Pallas kernels, noarch torch variants)")
    if len(set(backends)) != len(backends):
        raise fail(f"backends {backends!r} names a backend twice")

    repo_id = None
    if "hub" in general:
        hub = general["hub"]
        if not isinstance(hub, dict):
            raise fail("[general.hub] is not a table")
        _refuse_unknown(hub, _HUB_KEYS, "key in [general.hub]", fail)
        repo_id = hub.get("repo-id")
        if repo_id is not None and (not isinstance(repo_id, str) or not _REPO_ID.fullmatch(repo_id)):
            raise fail(f"[general.hub] repo-id {repo_id!r} is not ORG/NAME")

    noarch = document.get("torch-noarch")
    if noarch is None:
        raise fail("no [torch-noarch] table: tpu-kernels builds noarch torch variants (torch-<backend>); "
                   "add an empty [torch-noarch]")
    if not isinstance(noarch, dict) or noarch:
        raise fail(f"[torch-noarch] holds {sorted(noarch) if isinstance(noarch, dict) else noarch!r}: tpu-kernels "
                   "builds no compiled extension, so it takes no option; leave the table empty")
    return BuildToml(name=name, version=version, license=license_, backends=tuple(backends), repo_id=repo_id)


def _check_edition(general: dict, fail) -> None:
    edition = general.get("edition")
    if edition is None:
        raise fail(f"[general] has no `edition`: add `edition = {EDITION}`, the build.toml format of kernels 0.19")
    if not isinstance(edition, int) or isinstance(edition, bool):
        raise fail(f"edition {edition!r} is not an integer: set `edition = {EDITION}`")
    if edition < EDITION:
        raise fail(
            f"build.toml edition {edition} is an older format: set `edition = {EDITION}` in [general] (the format "
            f"kernels 0.19 reads; an older edition makes it print an upgrade warning on every build). The fields "
            f"tpu-kernels uses (name, version, license, backends, [general.hub] repo-id, [torch-noarch]) are "
            f"the same in edition {EDITION}: changing the number is all it takes.")
    if edition > EDITION:
        raise fail(f"build.toml edition {edition} is newer than this tpu-kernels builds (edition {EDITION})")


def _refuse_unknown(table: dict, known: tuple[str, ...], what: str, fail) -> None:
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise fail(f"unknown {what} {', '.join(map(repr, unknown))} (tpu-kernels builds with: {', '.join(known)}); "
                   "remove it")
