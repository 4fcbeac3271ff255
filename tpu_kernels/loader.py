"""`get_kernel`: the `kernels` library's loader, plus a digest check of every file before import.

Resolution, trust, version lookup, variant choice, download and import are
`kernels` 0.17.2's own (its resolvers, validators and dependency tree, used
exactly as `kernels.get_kernel` wires them). What this module adds between
download and import:

* the selected variant's files are hashed with `kernels`' `Digest.hash_variant`
  and compared with the `digest` of its metadata.json; a missing, extra or
  changed file stops the load with `KernelIntegrityError` naming the files
  (`kernels` parses the digest but never checks it);
* bytecode in the variant is removed before import and none is written:
  `hash_variant` skips `__pycache__`, so a planted `.pyc` whose header matches
  its source would otherwise run instead of the verified source;
* `force_download=True` re-fetches the variant from the Hub, which repairs a
  damaged cache;
* offline (HF_HUB_OFFLINE=1), the cached snapshot is checked for the selected
  variant only: `kernels`' own offline resolver asks huggingface_hub for the whole
  snapshot, which huggingface_hub >= 1.22 refuses as incomplete when the repo has
  other variants (a download fetches only one), so unmodified `kernels` 0.17.2
  cannot load a multi-variant kernel offline;
* a load by `version=` records `refs/v<N>` in the cache, so the same call works
  offline afterwards (`kernels` looks versions up there but never writes them).

The environment is read as huggingface_hub and kernels read it: HF_ENDPOINT,
HF_HUB_OFFLINE and KERNELS_CACHE (else HF_HUB_CACHE) when they are first
imported, so set them before; HF_TOKEN and LOCAL_KERNELS at each call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import LocalEntryNotFoundError
from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
from kernels import resolver as kernels_resolver
from kernels._rust import Digest, DigestValidationError, KernelDependency, KernelVersion, Metadata
from kernels._versions import resolve_kernel_version, revision_or_version
from kernels.deps import DepTreeNode, resolve_kernel_tree
from kernels.hf_hub import _check_trust_remote_code, _get_hf_api
from kernels.load import _get_local_kernel_overrides
from kernels.resolver import HubResolver, LocalKernel, SequentialResolver
from kernels.validate import AllValidator, ArchValidator, default_metadata_validators
from kernels.variants import get_variants_local, resolve_variant, variants_trace_str

logger = logging.getLogger(__name__)

BYTECODE_FOLDER = "__pycache__"
# Imports toggle the process-wide sys.dont_write_bytecode and fill kernels' module
# registry: one load at a time (re-entrant, for a kernel that loads another on import).
_LOAD_LOCK = threading.RLock()


class KernelIntegrityError(RuntimeError):
    """A kernel variant's files do not match the sha256 digests of its metadata.json."""

    def __init__(self, message: str, files: list[Path]):
        super().__init__(message)
        self.files = files


def get_kernel(
    repo_id: str,
    *,
    version: int | None = None,
    revision: str | None = None,
    backend: str | None = None,
    trust_remote_code: bool | list[str] = False,
    force_download: bool = False,
) -> ModuleType:
    """Load a kernel from the Hub (or HF_ENDPOINT) like `kernels.get_kernel`, after checking its digests.

    Args:
        repo_id: `namespace/name` of the kernel repo.
        version: major version, served from branch `v<version>`. Exactly one of version/revision.
        revision: branch, tag or commit sha.
        backend: `cpu`, `tpu`, ...; detected when None.
        trust_remote_code: True, or a list of repo ids allowed besides trusted publishers.
        force_download: fetch the variant's files again even if cached (repairs a damaged cache).

    Raises:
        KernelIntegrityError: a file of the selected variant is missing, extra or altered.
        ValueError: untrusted publisher, unknown version (the message lists the available ones),
            or both/neither of version and revision.
    """
    kernel = KernelDependency(repo_id=repo_id, version=revision_or_version(revision=revision, version=version))
    offline = constants.HF_HUB_OFFLINE
    if force_download and offline:
        raise ValueError("force_download=True needs the Hub, but HF_HUB_OFFLINE is set")
    api = _get_hf_api()
    hub_resolver = (CachedVariantResolver if offline else HubResolver)(trust_remote_code=trust_remote_code)
    tree = resolve_kernel_tree(
        api=api,
        backend=backend,
        kernel=kernel,
        resolver=SequentialResolver(resolvers=[_get_local_kernel_overrides(), hub_resolver]),
    )
    tree.validate_metadata(AllValidator(validators=[*default_metadata_validators(), ArchValidator()]))
    installed = tree.install(api=api)
    if force_download:
        _download_again(installed, api)
    _verify_tree(installed)
    if isinstance(kernel.version, KernelVersion.Version) and installed.location.origin is not None:
        _remember_version(repo_id, kernel.version.version, installed.location.origin.revision)
    with _LOAD_LOCK, _bytecode_writing_disabled():
        return installed.load()


@dataclass
class CachedVariantResolver:
    """`kernels`' HubCacheResolver (offline loads from the cache), checking only the variant it loads."""

    trust_remote_code: bool | list[str]

    def resolve(self, *, api: HfApi, backend: str | None, kernel: KernelDependency) -> LocalKernel:
        _check_trust_remote_code(kernel.repo_id, local_files_only=True, trust_remote_code=self.trust_remote_code)
        revision = resolve_kernel_version(kernel, local_files_only=True)
        storage = _download_cache() / repo_folder_name(repo_id=kernel.repo_id, repo_type="kernel")
        commit = revision if REGEX_COMMIT_HASH.fullmatch(revision) else _read_ref(storage / "refs" / revision)
        missing = FileNotFoundError(
            f"Cannot find a local snapshot for {kernel.repo_id} (revision: {revision}). When Hugging Face Hub "
            "is in offline mode the kernel must already be present in the local cache."
        )
        if commit is None:
            raise missing
        variant, trace = resolve_variant(get_variants_local(storage / "snapshots" / commit / "build"), backend)
        if variant is None:
            raise FileNotFoundError(
                f"Cannot find a cached build variant for this system in {kernel.repo_id} "
                f"(revision: {revision}):\n\n{variants_trace_str(trace)}"
            )
        try:
            snapshot = api.snapshot_download(
                kernel.repo_id,
                repo_type="kernel",
                revision=commit,
                cache_dir=kernels_resolver.CACHE_DIR,
                allow_patterns=[f"build/{variant.variant_str}/*"],
                ignore_patterns=kernels_resolver._BYTECODE_IGNORE_PATTERNS,
                local_files_only=True,
            )
        except LocalEntryNotFoundError as error:
            raise missing from error
        variant_path = Path(snapshot) / "build" / variant.variant_str
        return LocalKernel(variant_path=variant_path, metadata=Metadata.read_from_file(variant_path / "metadata.json"))


def _read_ref(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def verify_variant(variant_path: Path, *, source: str | None = None) -> None:
    """Check a variant folder against the digest of its metadata.json; raise KernelIntegrityError if it differs.

    `source` says where the variant came from, for the error message (defaults to the path).
    """
    variant_path = Path(variant_path)
    expected = Metadata.read_from_file(variant_path / "metadata.json").digest
    if expected is None:
        logger.warning("%s has no digest in metadata.json: its files cannot be verified", source or variant_path)
        return
    try:
        expected.validate(Digest.hash_variant(expected.algorithm, variant_path))
    except DigestValidationError as error:
        named = (getattr(violation, "path", None) for violation in error.violations)
        files = sorted({variant_path / path for path in named if path})
        details = "\n".join(f"  - {violation}" for violation in error.violations)
        raise KernelIntegrityError(
            f"Refusing to import {source or variant_path}: its files do not match the {expected.algorithm} digest "
            f"in {variant_path / 'metadata.json'}:\n{details}\nFiles: {', '.join(map(str, files))}",
            files,
        ) from None


def _nodes(tree: DepTreeNode[LocalKernel]) -> Iterator[LocalKernel]:
    yield tree.location
    for dep in tree.deps.values():
        yield from _nodes(dep)


def _verify_tree(tree: DepTreeNode[LocalKernel]) -> None:
    for kernel in _nodes(tree):
        origin = kernel.origin
        if origin is not None:
            source = f"{origin.repo_id} (revision {origin.revision}, variant {kernel.variant_str})"
            remedy = f"Download it again: tpu_kernels.get_kernel({origin.repo_id!r}, ..., force_download=True)."
        elif _in_download_cache(kernel.variant_path):
            source = f"cached kernel {kernel.variant_path}"
            remedy = "Download it again, online: tpu_kernels.get_kernel(..., force_download=True)."
        else:
            source, remedy = f"local kernel {kernel.variant_path}", "Rebuild it."
        try:
            verify_variant(kernel.variant_path, source=source)
        except KernelIntegrityError as error:
            raise KernelIntegrityError(f"{error}\n{remedy}", error.files) from None
        _remove_bytecode(kernel.variant_path)


def _download_cache() -> Path:
    return Path(kernels_resolver.CACHE_DIR or constants.HF_HUB_CACHE).resolve()


def _in_download_cache(path: Path) -> bool:
    return Path(path).resolve().is_relative_to(_download_cache())


def _download_again(tree: DepTreeNode[LocalKernel], api: HfApi) -> None:
    """Fetch every Hub variant of the tree again, replacing blobs and snapshot links in the cache."""
    for kernel in _nodes(tree):
        origin = kernel.origin
        if origin is None:
            continue
        # A file replaced in the snapshot (rather than edited through its link) would
        # survive a forced download, which only rewrites blobs: drop the links first.
        for path in kernel.variant_path.rglob("*"):
            if path.is_symlink() or path.is_file():
                path.unlink()
        # The snapshot folder is named by its commit: fetch exactly that one, even if
        # origin.revision is a branch that moved since.
        api.snapshot_download(
            origin.repo_id,
            repo_type="kernel",
            allow_patterns=[f"build/{kernel.variant_str}/*"],
            ignore_patterns=kernels_resolver._BYTECODE_IGNORE_PATTERNS,
            cache_dir=kernels_resolver.CACHE_DIR,
            revision=kernel.variant_path.parents[1].name,
            force_download=True,
        )


def _remove_bytecode(variant_path: Path) -> None:
    """Drop `__pycache__` folders so that only the verified sources get executed."""
    for folder, subfolders, _ in os.walk(variant_path):
        if BYTECODE_FOLDER in subfolders:
            # Best effort: a read-only cache keeps its bytecode, written by its owner.
            shutil.rmtree(Path(folder) / BYTECODE_FOLDER, ignore_errors=True)
            subfolders.remove(BYTECODE_FOLDER)


@contextlib.contextmanager
def _bytecode_writing_disabled() -> Iterator[None]:
    previous = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        yield
    finally:
        sys.dont_write_bytecode = previous


def _remember_version(repo_id: str, version: int, commit: str) -> None:
    """Write refs/v<version> -> commit in the cache, where `kernels` looks versions up when offline."""
    ref = _download_cache() / repo_folder_name(repo_id=repo_id, repo_type="kernel") / "refs" / f"v{version}"
    with contextlib.suppress(FileNotFoundError):
        if ref.read_text() == commit:
            return
    ref.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=ref.parent, prefix=f".v{version}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(commit)
    os.replace(staging, ref)
