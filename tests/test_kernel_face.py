"""Code outside ragged-dot-tpu's package reaches the loaded kernel only through its face: the names its
`__init__.py` lists in `__all__` (what a user calls) and `TOOLS` (what tools use besides). Read from the
source with `ast`; nothing is imported or compiled.

Outside is this project's tests, tpu_kernels (benchmarks, the performance model, integration) and the kernel
repo's own tests. Two checks cover it:

- on the names that hold the loaded kernel (the `kernel` fixture in the kernel repo's tests, the
  `ragged_dot_kernel` fixture here, `kernels["ragged-dot-tpu"]`, a kernel loaded from a ragged-dot build, and
  the names these are assigned or returned to): every attribute, `getattr` and `setattr` is a name of the
  face, and under a face module (`reference`, `ops`) a name that module binds;
- on any name at all (tpu_kernels passes the loaded kernel around under names of its own): no attribute chain
  goes through a module of the package that is not in the face to a name that module binds (`x.gmm.kernel`,
  `x.plan.plan_experts`), and no string names such a pair ("layer.experts_layer", as a `getattr` path would).

Imports of the package itself (`from ragged_dot_tpu.gmm import ...`) take only face names from the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

KERNEL_REPO = REPO_ROOT / "kernel_repos" / "ragged-dot-tpu"
PACKAGE = KERNEL_REPO / "torch-ext" / "ragged_dot_tpu"
PACKAGE_NAME = "ragged_dot_tpu"
OUTSIDE = [REPO_ROOT / "tests", REPO_ROOT / "tpu_kernels", KERNEL_REPO / "tests"]
# Names that hold the loaded kernel wherever they appear, and in the kernel repo's own tests.
HANDLE_NAMES = {"ragged_dot_kernel"}
KERNEL_TESTS_HANDLE_NAMES = {"kernel"}
# Calls that load a kernel: one of ragged-dot's when an argument names its repo or build.
LOADERS = {"get_local_kernel", "get_kernel", "load_kernel"}


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
    return names


def package_modules() -> dict[str, set[str]]:
    """{dotted module path under the package ("" for the package): the names it binds, and its child modules}."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[dotted] = _bound_names(ast.parse(path.read_text()))
    for dotted in list(modules):
        if dotted:
            parent, _, child = dotted.rpartition(".")
            modules.setdefault(parent, set()).add(child)
    return modules


FACE_LISTS = ("__all__", "TOOLS")  # what a user calls, and what tools use besides


def face() -> list[str]:
    """The names of `__init__.py`'s `__all__` and `TOOLS`, in that order."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    lists = {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name) and target.id in FACE_LISTS}
    return [name for listed in FACE_LISTS for name in lists[listed]]


def missing_from_the_package(names: list[str], modules: dict[str, set[str]]) -> list[str]:
    """The names of `names` that `__init__.py` does not import, or imports from a module that does not bind them."""
    init = ast.parse((PACKAGE / "__init__.py").read_text())
    sources = {alias.asname or alias.name: (node.module or "", alias.name) for node in init.body
               if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names}
    return [name for name in names
            if name not in sources or sources[name][1] not in modules.get(sources[name][0], set())]


class _Handles(ast.NodeVisitor):
    """The names of one file that hold the loaded ragged-dot kernel, grown from its seeds to a fixed point."""

    def __init__(self, tree: ast.Module, seeds: set[str]):
        self.names = set(seeds)
        while True:
            before = len(self.names)
            self.visit(tree)
            if len(self.names) == before:
                break

    def holds_kernel(self, node: ast.AST | None) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and node.slice.value == "ragged-dot-tpu"
        if isinstance(node, ast.Call):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if function in LOADERS:
                return any(_names_ragged_dot(argument) for argument in [*node.args, *node.keywords])
            return isinstance(node.func, ast.Name) and node.func.id in self.names  # a fixture called
        return False

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                     and isinstance(node.value, ast.Tuple) else [(target, node.value)])
            for name, value in pairs:
                if isinstance(name, ast.Name) and self.holds_kernel(value):
                    self.names.add(name.id)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        """A function returning the kernel (a fixture): its name, as a parameter elsewhere, holds the kernel."""
        if any(isinstance(statement, ast.Return) and self.holds_kernel(statement.value) for statement in node.body):
            self.names.add(node.name)
        self.generic_visit(node)


def _names_ragged_dot(node: ast.AST) -> bool:
    """Whether an expression mentions ragged-dot's repo by a string or by a name (`ragged_dot_build`)."""
    return any((isinstance(part, ast.Constant) and isinstance(part.value, str) and "ragged-dot-tpu" in part.value)
               or (isinstance(part, ast.Name) and "ragged_dot" in part.id) for part in ast.walk(node))


def _chain(node: ast.Attribute) -> tuple[ast.AST, list[str], list[ast.Attribute]]:
    """`a.b.c` as (the root expression `a`, ["b", "c"], the attribute nodes of the chain)."""
    spine = []
    while isinstance(node, ast.Attribute):
        spine.append(node)
        node = node.value
    return node, [attribute.attr for attribute in reversed(spine)], spine


def _attribute_steps(tree: ast.Module) -> list[tuple[int, ast.AST, list[str]]]:
    """Every attribute chain of a file as (line, root, names), `getattr(x, "a")` and `setattr(x, "a", ...)`
    (also monkeypatch's) as `x.a`; only the longest chain of nested attributes."""
    steps, inner = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            root, names, spine = _chain(node)
            steps.append((node.lineno, root, names))
            inner.update(id(attribute) for attribute in spine)
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)
              and (getattr(node.func, "id", None) in ("getattr", "setattr")
                   or getattr(node.func, "attr", None) in ("setattr", "delattr"))):
            target = node.args[0]
            root, names, _ = _chain(target) if isinstance(target, ast.Attribute) else (target, [], [])
            steps.append((node.lineno, root, [*names, node.args[1].value]))
    return steps


def face_violations(source: str, filename: str, kernel_tests: bool, names: list[str],
                    modules: dict[str, set[str]]) -> list[str]:
    """Each place `source` reaches the kernel outside its face, as `file:line: what`."""
    tree = ast.parse(source, filename)
    allowed = set(names)
    outside_face = {dotted for dotted in modules if dotted and "." not in dotted} - allowed
    handles = _Handles(tree, HANDLE_NAMES | (KERNEL_TESTS_HANDLE_NAMES if kernel_tests else set()))
    found = [f"{filename}:{line}: {what}" for line, what in _import_violations(tree, allowed)]
    for line, root, chain in _attribute_steps(tree):
        if handles.holds_kernel(root) and chain and not chain[0].startswith("__"):
            if chain[0] not in allowed:
                found.append(f"{filename}:{line}: {ast.unparse(root)}.{chain[0]} is not in the face")
            elif len(chain) > 1 and chain[0] in modules and chain[1] not in modules[chain[0]]:
                found.append(f"{filename}:{line}: {chain[0]}.{chain[1]} is not a name of the face module {chain[0]}")
        for module, name in zip(chain, chain[1:]):
            if module in outside_face and name in modules[module]:
                found.append(f"{filename}:{line}: .{module}.{name} reaches into the kernel past its face")
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count(".") == 1:
            module, _, name = node.value.partition(".")
            if module in outside_face and name in modules[module]:
                found.append(f"{filename}:{node.lineno}: {node.value!r} names a path into the kernel past its face")
    return sorted(set(found))


def _import_violations(tree: ast.Module, allowed: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {alias.name}") for alias in node.names
                      if alias.name.split(".")[0] == PACKAGE_NAME and alias.name != PACKAGE_NAME]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == PACKAGE_NAME:
            found += [(node.lineno, f"from {node.module} import {alias.name}") for alias in node.names
                      if node.module != PACKAGE_NAME or alias.name not in allowed]
    return found


def _outside_files() -> list[Path]:
    return sorted(path for root in OUTSIDE for path in root.rglob("*.py") if "__pycache__" not in path.parts)


def test_the_face_names_only_what_the_package_binds():
    modules = package_modules()
    assert missing_from_the_package(face(), modules) == []
    assert len(face()) == len(set(face()))


def test_code_outside_the_kernel_uses_only_its_face():
    names, modules = face(), package_modules()
    found = [violation for path in _outside_files()
             for violation in face_violations(path.read_text(), str(path.relative_to(REPO_ROOT)),
                                              KERNEL_REPO in path.parents, names, modules)]
    assert found == []


@pytest.mark.parametrize(("source", "kernel_tests"), [
    ("def test(kernel):\n    kernel.gmm.kernel.grouped_matmul(x)", True),
    ("def test(kernel):\n    kernel.plan.plan_experts(problem)", True),
    ("def test(ragged_dot_kernel):\n    ragged_dot_kernel.layer", False),
    ("def f(built):\n    return built.common.quant.NOT_SERVED", False),
    ("def test(monkeypatch, kernel):\n    monkeypatch.setattr(kernel.plan, 'FUSED_MAX_TOKENS', 8)", True),
    ("def test(kernel):\n    getattr(kernel, 'schedule')", True),
    ("def test(kernel):\n    kernel.reference.no_such_reference", True),
    ("ragged = kernels['ragged-dot-tpu']\nragged.tiles", False),
    ("k = get_local_kernel(ragged_dot_build, backend='cpu')\nk.no_such_name", False),
    ("import pytest\n@pytest.fixture\ndef kernel(ragged_dot_kernel):\n    return ragged_dot_kernel\n"
     "def test(kernel):\n    kernel.no_such_name", False),
    ("ENTRY = 'layer.experts_layer'", False),
    ("from ragged_dot_tpu.gmm.kernel import grouped_matmul", False),
])
def test_the_check_catches_reaching_past_the_face(source, kernel_tests):
    assert face_violations(source, "example.py", kernel_tests, face(), package_modules())


def test_the_check_passes_the_face():
    source = ("def test(kernel, monkeypatch):\n    kernel.grouped_matmul(x, config=kernel.TileConfig(8, 128, 128))\n"
              "    kernel.reference.ragged_dot_reference(x)\n    kernel.TUNED_TILES.clear()\n"
              "    monkeypatch.setattr(kernel.ops, 'check_group_sizes', None)\n"
              "def other(model, kernel):\n    return model.config.vocab_size, kernel.__name__\n")
    assert face_violations(source, "example.py", True, face(), package_modules()) == []
