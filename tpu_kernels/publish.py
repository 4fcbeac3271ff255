"""`tpu-kernels upload build/<name> --repo-id ORG/NAME`: publish a build through huggingface_hub.

The Hub layout `kernels` expects:

    main    README.md (the kernel card)
    v<N>    README.md, build/<variant>/..., benchmarks/...   (N: the kernel's major version)

One upload makes one commit per branch it changes: the card on `main` (skipped
when unchanged), and on `v<N>` the whole build, with files of an earlier
upload that the build no longer has deleted in the same commit. Everything
goes through `HfApi` (create_repo, create_branch, list_repo_files,
create_commit), so the same command publishes to huggingface.co or to a
`tpu-kernels serve` hub (HF_ENDPOINT or --endpoint); the token comes from
HF_TOKEN or `hf auth login`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitInfo, CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import HfHubHTTPError
from kernels._rust import Metadata

from .loader import KernelIntegrityError, verify_variant

PUBLISHED_FOLDERS = ("build", "benchmarks")
CARD = "README.md"
MAIN_BRANCH = "main"


@dataclass(frozen=True)
class KernelBuild:
    """What `tpu-kernels build` wrote for one kernel."""

    root: Path
    name: str
    version: int
    variants: tuple[str, ...]

    @classmethod
    def open(cls, root: Path) -> KernelBuild:
        root = Path(root)
        variant_dirs = sorted(path.parent for path in (root / "build").glob("*/metadata.json"))
        if not variant_dirs:
            raise FileNotFoundError(f"{root} is not a kernel build: no build/<variant>/metadata.json")
        metadata = {path.name: Metadata.read_from_file(path / "metadata.json") for path in variant_dirs}
        names = {str(meta.name) for meta in metadata.values()}
        versions = {meta.version for meta in metadata.values()}
        if len(names) != 1 or len(versions) != 1 or None in versions:
            raise ValueError(
                f"{root}: variants disagree on name/version or lack a version: "
                + ", ".join(f"{variant}: {meta.name} v{meta.version}" for variant, meta in metadata.items())
            )
        for path in variant_dirs:
            try:
                verify_variant(path)
            except KernelIntegrityError as error:
                raise KernelIntegrityError(f"{error}\nRebuild before uploading.", error.files) from None
        return cls(root=root, name=names.pop(), version=versions.pop(), variants=tuple(p.name for p in variant_dirs))

    def published_files(self) -> dict[str, Path]:
        """Repo path -> local file, without bytecode (a load writes it next to the sources)."""
        files = {}
        for folder in PUBLISHED_FOLDERS:
            for path in sorted((self.root / folder).rglob("*")):
                relative = path.relative_to(self.root)
                if path.is_file() and "__pycache__" not in relative.parts and path.suffix != ".pyc":
                    files[relative.as_posix()] = path
        if (self.root / CARD).is_file():
            files[CARD] = self.root / CARD
        return files


@dataclass(frozen=True)
class Publication:
    repo_id: str
    branch: str
    card_commit: CommitInfo | None
    build_commit: CommitInfo


def upload_kernel(
    build_dir: str | Path,
    repo_id: str,
    *,
    version: int | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> Publication:
    """Publish `build_dir` (README on main, the build on v<version>) and return the commits made.

    `version` defaults to the version in the build's metadata; `endpoint` to
    HF_ENDPOINT; `token` to HF_TOKEN or the stored login.
    """
    build = KernelBuild.open(Path(build_dir))
    version = build.version if version is None else version
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    branch = f"v{version}"
    api = HfApi(endpoint=endpoint, token=token)
    api.create_repo(repo_id, repo_type="kernel", exist_ok=True)
    files = build.published_files()

    card_commit = None
    if CARD in files:
        card_commit = api.create_commit(
            repo_id,
            repo_type="kernel",
            revision=MAIN_BRANCH,
            operations=[CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=files[CARD])],
            commit_message=f"Update the {build.name} card ({branch})",
        )

    api.create_branch(repo_id, repo_type="kernel", branch=branch, exist_ok=True)
    remote = api.list_repo_files(repo_id, repo_type="kernel", revision=branch)
    stale = sorted(
        path for path in remote
        if path.split("/", 1)[0] in PUBLISHED_FOLDERS and path not in files
    )
    operations = [CommitOperationDelete(path_in_repo=path) for path in stale]
    operations += [CommitOperationAdd(path_in_repo=path, path_or_fileobj=local) for path, local in files.items()]
    build_commit = api.create_commit(
        repo_id,
        repo_type="kernel",
        revision=branch,
        operations=operations,
        commit_message=f"Upload {build.name} {branch} ({', '.join(build.variants)})",
        commit_description=(
            f"{len(files)} files from {build.root.name}/"
            + (f", {len(stale)} stale files removed: {', '.join(stale)}" if stale else "")
        ),
    )
    return Publication(repo_id=repo_id, branch=branch, card_commit=card_commit, build_commit=build_commit)


def upload_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tpu-kernels upload",
        description="Publish a kernel build: README.md on main, build/ and benchmarks/ on branch v<N>. "
        "The token comes from HF_TOKEN (or `hf auth login`).",
    )
    parser.add_argument("build_dir", type=Path, help="build/<name>, as written by `tpu-kernels build`")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME of the kernel repo (created if missing)")
    parser.add_argument("--version", type=int, help="major version N, published on branch vN (default: from metadata)")
    parser.add_argument("--endpoint", help="Hub URL, e.g. a `tpu-kernels serve` hub (default: HF_ENDPOINT)")
    args = parser.parse_args(argv)
    try:
        publication = upload_kernel(args.build_dir, args.repo_id, version=args.version, endpoint=args.endpoint)
    except (FileNotFoundError, ValueError, KernelIntegrityError, HfHubHTTPError) as error:
        print(f"upload failed: {error}", file=sys.stderr)
        return 1
    if publication.card_commit is not None:
        print(f"{CARD} on {MAIN_BRANCH}: {publication.card_commit.commit_url}")
    print(f"build on {publication.branch}: {publication.build_commit.commit_url}")
    return 0
