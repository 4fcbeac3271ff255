"""Our code reaches kernels, huggingface_hub, transformers and torch through their public APIs only, and patches
none of them: a private name (a module or name with a leading underscore, at any depth) or an assignment to
an attribute of one of their modules fails here, naming the file and line. A new release that moves its
internals then cannot break a user's install of ours. What a build ships (the runtime and the kernels'
packages) holds jax to the same rule: a jax release that moved a private would break every built kernel,
on TPU too. The performance model (benchmarks/perf) reads jax's internals on purpose and ships nowhere."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

LIBRARIES = ("kernels", "huggingface_hub", "transformers", "torch")
CHECKED = [REPO_ROOT / "tpu_kernels", REPO_ROOT / "kernel_repos"]
SHIPPED_LIBRARIES = (*LIBRARIES, "jax", "jaxlib")
SHIPPED = [REPO_ROOT / "tpu_kernels" / "runtime", *(REPO_ROOT / "kernel_repos").glob("*/torch-ext")]


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
               for part in dotted.split("."))


def _outside_kernels_api(module: str, name: str | None) -> bool:
    """kernels' public API is what `kernels/__init__.py` exports: no submodule, no name outside `__all__`."""
    import kernels

    parts = module.split(".")
    return parts[0] == "kernels" and (len(parts) > 1 or (name is not None and name not in kernels.__all__))


def private_uses(source: str, filename: str, libraries: tuple[str, ...] = LIBRARIES) -> list[str]:
    """Each place `source` imports, reaches or patches a private part of `libraries`, as `file:line: what`."""

    def _library(module: str | None) -> bool:
        return module is not None and module.split(".")[0] in libraries

    tree = ast.parse(source, filename)
    bound: set[str] = set()  # local names bound to a module (or object) of the libraries
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _library(alias.name):
                    bound.add((alias.asname or alias.name).split(".")[0])
                    if _private(alias.name) or _outside_kernels_api(alias.name, None):
                        found.append(f"{filename}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _library(node.module):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if _private(f"{node.module}.{alias.name}") or _outside_kernels_api(node.module, alias.name):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _rooted_in(node, bound):
            dotted = _dotted(node)
            if dotted is not None and _private(dotted):
                found.append(f"{filename}:{node.lineno}: {dotted}")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and _rooted_in(target, bound):
                found.append(f"{filename}:{node.lineno}: assigns {_dotted(target)} (patches the library)")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)) and _rooted_in(node.args[0], bound)):
            found.append(f"{filename}:{node.lineno}: {node.func.id}({ast.unparse(node.args[0])}, ...) (patches the library)")
    return sorted(set(found))


def _rooted_in(node: ast.expr, bound: set[str]) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in bound


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _python_files(roots: list[Path]) -> list[Path]:
    return sorted(path for root in roots for path in root.rglob("*.py") if "__pycache__" not in path.parts)


def test_our_code_uses_only_public_names_of_the_libraries():
    found = [use for path in _python_files(CHECKED)
             for use in private_uses(path.read_text(), str(path.relative_to(REPO_ROOT)))]
    assert found == []


def test_shipped_code_uses_only_public_names_of_jax_too():
    assert len(SHIPPED) == 4  # the runtime and three kernel packages: a moved folder must not empty the check
    found = [use for path in _python_files(SHIPPED)
             for use in private_uses(path.read_text(), str(path.relative_to(REPO_ROOT)), SHIPPED_LIBRARIES)]
    assert found == []


def test_the_shipped_check_catches_a_jax_private():
    assert private_uses("from jax._src.pallas.mosaic.interpret import interpret_pallas_call", "example.py",
                        SHIPPED_LIBRARIES)


@pytest.mark.parametrize("source", [
    "from kernels._rust import Metadata",
    "import kernels._internals.resolver",
    "from huggingface_hub.file_download import _get_metadata_or_catch_error",
    "import kernels\nkernels._internals.importer",
    "from huggingface_hub import file_download\nfile_download.hf_hub_download = None",
    "import torch\nsetattr(torch.library, 'x', 1)",
    "import transformers.integrations as t\nt._private_helper()",
    "from kernels.benchmark import Benchmark",
    "from kernels import resolver",
    "from huggingface_hub.utils._http import y",
])
def test_the_check_catches_private_uses_and_patches(source):
    assert private_uses(source, "example.py")


def test_the_check_passes_public_uses():
    source = ("import kernels\nfrom kernels import Metadata, get_kernel_variants\nimport torch\n"
              "torch.library.custom_op\nfrom huggingface_hub import HfApi\nx = kernels.__version__\n")
    assert private_uses(source, "example.py") == []
