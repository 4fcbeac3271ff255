"""docs/architecture.md's layout matches the tree, as the README's limits are held by test_code_limits.

The layout is the fenced block under `## Layout`. Each of its lines names one path, nested two spaces under the
line it belongs to (`tpu_kernels/` then `  cli.py`), then at least two spaces and what it is; a name may hold a
slash (`torch-ext/ragged_dot_tpu/`), and a folder's name ends in one. Held here: every path it names exists (a
folder as a folder), it names every package (a folder with `__init__.py`) of tpu_kernels/, benchmarks/ and
kernel_repos/, and every module of the product's package, tpu_kernels/ (its packages' `__init__.py` aside).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

DOC = REPO_ROOT / "docs" / "architecture.md"
PACKAGE_ROOTS = ("tpu_kernels", "benchmarks", "kernel_repos")
MODULE_ROOT = "tpu_kernels"
STEP = 2  # spaces per level
LINE = re.compile(r"^(?P<indent> *)(?P<name>[\w.-]+(?:/[\w.-]+)*/?)(?: {2,}\S.*)?$")


class LayoutError(ValueError):
    """A line of the layout that names no path, or sits deeper than one level under the line above."""


def layout_lines(text: str) -> list[str]:
    """The lines of the fenced block under the `## Layout` heading."""
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].strip("\n").splitlines()


def named_paths(lines: list[str]) -> list[str]:
    """Each line's path from the repo's root, in order (a folder's with its trailing slash)."""
    parents: list[str] = []  # the path of the line at each level above the current one
    paths = []
    for number, line in enumerate(lines, 1):
        match = LINE.match(line)
        if match is None:
            raise LayoutError(f"line {number} names no path: {line!r}")
        level, rest = divmod(len(match["indent"]), STEP)
        if rest or level > len(parents):
            raise LayoutError(f"line {number} is not nested {STEP} spaces under the line above: {line!r}")
        del parents[level:]
        path = (parents[-1] if parents else "") + match["name"]
        paths.append(path)
        parents.append(path if path.endswith("/") else path + "/")  # under a file, a path that cannot exist
    return paths


def missing(paths: list[str], root: Path) -> list[str]:
    return [path for path in paths if not ((root / path).is_dir() if path.endswith("/") else (root / path).is_file())]


def tree_packages(root: Path) -> set[str]:
    return {init.parent.relative_to(root).as_posix() + "/" for folder in PACKAGE_ROOTS
            for init in (root / folder).rglob("__init__.py") if "__pycache__" not in init.parts}


def product_modules(root: Path) -> set[str]:
    return {path.relative_to(root).as_posix() for path in (root / MODULE_ROOT).rglob("*.py")
            if "__pycache__" not in path.parts and not (path.name == "__init__.py" and path.parent != root / MODULE_ROOT)}


@pytest.fixture(scope="module")
def named() -> list[str]:
    return named_paths(layout_lines(DOC.read_text()))


def test_every_path_the_layout_names_exists(named):
    assert missing(named, REPO_ROOT) == []
    assert len(named) == len(set(named))


def test_the_layout_names_every_package_of_the_product_the_kernels_and_the_lab(named):
    assert sorted(tree_packages(REPO_ROOT) - set(named)) == []


def test_the_layout_names_every_module_of_the_product(named):
    assert sorted(product_modules(REPO_ROOT) - set(named)) == []


def test_a_stale_or_misnested_layout_is_found(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/a.py"):
        (tmp_path / name).write_text("")
    paths = named_paths(["pkg/      the package", "  a.py    a module", "  gone.py", "  sub/"])
    assert paths == ["pkg/", "pkg/a.py", "pkg/gone.py", "pkg/sub/"]
    assert missing(paths, tmp_path) == ["pkg/gone.py"]
    assert missing(named_paths(["pkg/", "  a.py", "    b.py"]), tmp_path) == ["pkg/a.py/b.py"]
    for lines in (["pkg/", "    a.py"], ["pkg/", "   a.py"], ["pkg/ the package"]):
        with pytest.raises(LayoutError):
            named_paths(lines)
