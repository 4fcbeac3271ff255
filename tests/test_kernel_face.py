"""Code outside a kernel's package reaches the loaded kernel only through its face: the names its `__init__.py`
lists in `__all__` (what a user calls) and `TOOLS` (what tools use besides). Read from the source with `ast`;
nothing is imported or compiled. The kernels held to their faces: ragged-dot-tpu, attention-tpu and rmsnorm-tpu.

A face name is a name the package binds (`MatmulProblem`) or a dotted path through the subpackages it binds to
one name of a module (`gmm.plan.make`): each kernel's seams, `tiles.select`, `plan.make` and `kernel.call`, and
the few names beside them the face lists. Through a dotted path only the names the face lists are reachable.

Outside is this project's tests, tpu_kernels (benchmarks, the performance model, integration) and the kernel
repo's own tests. Two checks cover it:

- on the names that hold the loaded kernel (the `kernel` fixture in the kernel repo's tests, a fixture here
  such as `ragged_dot_kernel`, `kernels["ragged-dot-tpu"]`, a kernel loaded from one of its builds, and the
  names these are assigned or returned to): every attribute, `getattr` and `setattr` is a name of the face,
  and under a face module (`reference`, `ops`) a name that module binds;
- on any name at all (tpu_kernels passes the loaded kernel around under names of its own): no attribute chain
  goes through a module of the package that is not in the face to a name that module binds, unless the path
  is (or leads to) a dotted face name (`x.gmm.kernel.scheduled_matmul_call`, `x.plan.plan_experts`,
  `x.flash.kernel.attention_forward`), and no string names such a path ("layer.experts_layer", as a `getattr`
  path would).

Imports of the package itself (`from ragged_dot_tpu.gmm import ...`) take only face names from the package.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from .conftest import REPO_ROOT



@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel repo whose package has a face, and how code outside names its loaded kernel."""

    repo_name: str  # its folder under kernel_repos/, as `kernels[...]` and the builds name it
    package_name: str
    handle_names: frozenset[str]  # names that hold the loaded kernel wherever they appear (this project's fixtures)
    build_name_part: str  # a name with this in it, given to a loader, holds one of its builds (`ragged_dot_build`)

    @property
    def repo(self) -> Path:
        return REPO_ROOT / "kernel_repos" / self.repo_name

    @property
    def package(self) -> Path:
        return self.repo / "torch-ext" / self.package_name

    @property
    def outside(self) -> list[Path]:
        return [REPO_ROOT / "tests", REPO_ROOT / "tpu_kernels", self.repo / "tests"]


RAGGED_DOT = Kernel("ragged-dot-tpu", "ragged_dot_tpu", frozenset({"ragged_dot_kernel"}), "ragged_dot")
ATTENTION = Kernel("attention-tpu", "attention_tpu", frozenset(), "attention_build")
RMSNORM = Kernel("rmsnorm-tpu", "rmsnorm_tpu", frozenset(), "rmsnorm_build")
KERNELS = [RAGGED_DOT, ATTENTION, RMSNORM]
# Names that hold the loaded kernel in the kernel repo's own tests.
KERNEL_TESTS_HANDLE_NAMES = {"kernel"}
# Calls that load a kernel: one of a kernel's when an argument names its repo or build.
LOADERS = {"get_local_kernel", "get_kernel", "load_kernel"}
# In the name of a mapping from kernel repo names to build folders (`kernel_builds`, `published.builds`).
BUILD_FOLDERS_NAME_PART = "builds"


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


def package_modules(kernel: Kernel) -> dict[str, set[str]]:
    """{dotted module path under the package ("" for the package): the names it binds, and its child modules}."""
    modules = {}
    for path in sorted(kernel.package.rglob("*.py")):
        parts = path.relative_to(kernel.package).with_suffix("").parts
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[dotted] = _bound_names(ast.parse(path.read_text()))
    for dotted in list(modules):
        if dotted:
            parent, _, child = dotted.rpartition(".")
            modules.setdefault(parent, set()).add(child)
    return modules


FACE_LISTS = ("__all__", "TOOLS")  # what a user calls, and what tools use besides


def face(kernel: Kernel) -> list[str]:
    """The names of `__init__.py`'s `__all__` and `TOOLS`, in that order."""
    tree = ast.parse((kernel.package / "__init__.py").read_text())
    lists = {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name) and target.id in FACE_LISTS}
    return [name for listed in FACE_LISTS for name in lists[listed]]


def missing_from_the_package(kernel: Kernel, names: list[str], modules: dict[str, set[str]]) -> list[str]:
    """The names of `names` that `__init__.py` does not import, or imports from a module that does not bind them;
    and the dotted ones whose modules are not each bound by name in their package's `__init__.py` (as `kernels`
    needs: see ragged_dot_tpu's), or whose module does not bind their last name."""
    init = ast.parse((kernel.package / "__init__.py").read_text())
    sources = {alias.asname or alias.name: (node.module or "", alias.name) for node in init.body
               if isinstance(node, ast.ImportFrom) and node.level == 1 for alias in node.names}
    missing = [name for name in names if "." not in name
               and (name not in sources or sources[name][1] not in modules.get(sources[name][0], set()))]
    for name in names:
        parts = name.split(".")
        if "." in name and not (all(_binds_module(kernel, parts[:end]) for end in range(1, len(parts)))
                                and parts[-1] in modules.get(".".join(parts[:-1]), set())):
            missing.append(name)
    return missing


def _binds_module(kernel: Kernel, parts: list[str]) -> bool:
    """Whether the package `parts[:-1]` (under the kernel's) binds its module `parts[-1]` by an import."""
    init = kernel.package.joinpath(*parts[:-1], "__init__.py")
    return init.exists() and any(alias.name == parts[-1] and node.level == 1 and not node.module
                                 for node in ast.parse(init.read_text()).body if isinstance(node, ast.ImportFrom)
                                 for alias in node.names)


SEAMS = ("tiles.select", "plan.make", "kernel.call")  # each kernel subpackage's, under its name


def dotted_subpackages(names: list[str]) -> set[str]:
    """The subpackages a face reaches into (`gmm` of `gmm.plan.make`)."""
    return {name.split(".")[0] for name in names if "." in name}


class _Handles(ast.NodeVisitor):
    """The names of one file that hold one kernel's loaded module, grown from its seeds to a fixed point."""

    def __init__(self, tree: ast.Module, seeds: set[str], kernel: Kernel):
        self.names = set(seeds)
        self.kernel = kernel
        while True:
            before = len(self.names)
            self.visit(tree)
            if len(self.names) == before:
                break

    def holds_kernel(self, node: ast.AST | None) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.names
        if isinstance(node, ast.Subscript):
            # `kernels["rmsnorm-tpu"]` holds the loaded kernel; `kernel_builds["rmsnorm-tpu"]` (or
            # `published.builds[...]`) its build folder, a kernel only once given to a loader.
            return (isinstance(node.slice, ast.Constant) and node.slice.value == self.kernel.repo_name
                    and BUILD_FOLDERS_NAME_PART not in _last_name(node.value))
        if isinstance(node, ast.Call):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if function in LOADERS:
                return any(_names_kernel(argument, self.kernel) for argument in [*node.args, *node.keywords])
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


def _names_kernel(node: ast.AST, kernel: Kernel) -> bool:
    """Whether an expression mentions the kernel's repo by a string or by a name (`ragged_dot_build`)."""
    return any((isinstance(part, ast.Constant) and isinstance(part.value, str) and kernel.repo_name in part.value)
               or (isinstance(part, ast.Name) and kernel.build_name_part in part.id) for part in ast.walk(node))


def _last_name(node: ast.AST) -> str:
    """The name an expression ends in: `b` of `a.b` and of `b`; "" for anything else."""
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


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
            root, names, spine = _chain(target) if isinstance(target, ast.Attribute) else (target, [], [])
            steps.append((node.lineno, root, [*names, node.args[1].value]))
            inner.update(id(attribute) for attribute in spine)
    return steps


def face_violations(source: str, filename: str, kernel_tests: bool, kernel: Kernel, names: list[str],
                    modules: dict[str, set[str]]) -> list[str]:
    """Each place `source` reaches the kernel outside its face, as `file:line: what`."""
    tree = ast.parse(source, filename)
    allowed = {name for name in names if "." not in name}
    dotted = {name for name in names if "." in name}
    outside_face = {module for module in modules if module and "." not in module} - allowed
    handles = _Handles(tree, kernel.handle_names | (KERNEL_TESTS_HANDLE_NAMES if kernel_tests else set()), kernel)
    found = [f"{filename}:{line}: {what}" for line, what in _import_violations(tree, allowed, kernel.package_name)]
    for line, root, chain in _attribute_steps(tree):
        if handles.holds_kernel(root) and chain and not chain[0].startswith("__"):
            reaches_dotted = any(".".join(chain[:end]) in dotted for end in range(2, len(chain) + 1))
            if chain[0] not in allowed and not reaches_dotted:
                found.append(f"{filename}:{line}: {ast.unparse(root)}.{'.'.join(chain)} is not in the face")
            elif chain[0] in allowed and len(chain) > 1 and chain[0] in modules and chain[1] not in modules[chain[0]]:
                found.append(f"{filename}:{line}: {chain[0]}.{chain[1]} is not a name of the face module {chain[0]}")
        start = 0
        while start < len(chain):  # a path walked from one module is not walked again from its inner modules
            past, walked = _past_the_face(chain[start:], outside_face, dotted, modules)
            if past:
                found.append(f"{filename}:{line}: .{past} reaches into the kernel past its face")
            start += walked
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            past, _ = _past_the_face(node.value.split("."), outside_face, dotted, modules)
            if past:
                found.append(f"{filename}:{node.lineno}: {node.value!r} names a path into the kernel past its face")
    return sorted(set(found))


def _past_the_face(chain: list[str], outside_face: set[str], dotted: set[str],
                   modules: dict[str, set[str]]) -> tuple[str, int]:
    """The path of `chain` (from a module of the package outside the face) to a name its module binds that is
    neither a dotted face name nor on the way to one ("" where there is none), and how many names of `chain`
    the walk took (at least one)."""
    if not chain or chain[0] not in outside_face:
        return "", 1
    path = chain[0]
    for walked, name in enumerate(chain[1:], start=2):
        if name not in modules.get(path, set()):
            return "", walked - 1
        path = f"{path}.{name}"
        if path in dotted:
            return "", walked
        if not any(face_name.startswith(path + ".") for face_name in dotted):
            return path, walked
    return "", len(chain)


def _import_violations(tree: ast.Module, allowed: set[str], package_name: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {alias.name}") for alias in node.names
                      if alias.name.split(".")[0] == package_name and alias.name != package_name]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == package_name:
            found += [(node.lineno, f"from {node.module} import {alias.name}") for alias in node.names
                      if node.module != package_name or alias.name not in allowed]
    return found


def _outside_files(kernel: Kernel) -> list[Path]:
    return sorted(path for root in kernel.outside for path in root.rglob("*.py") if "__pycache__" not in path.parts)


def _violations(kernel: Kernel, source: str, kernel_tests: bool) -> list[str]:
    return face_violations(source, "example.py", kernel_tests, kernel, face(kernel), package_modules(kernel))


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.repo_name)
def test_the_face_names_only_what_the_package_binds(kernel):
    modules = package_modules(kernel)
    assert missing_from_the_package(kernel, face(kernel), modules) == []
    assert len(face(kernel)) == len(set(face(kernel)))


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.repo_name)
def test_each_kernel_the_face_reaches_into_has_its_seams(kernel):
    names = face(kernel)
    assert [f"{package}.{seam}" for package in sorted(dotted_subpackages(names)) for seam in SEAMS
            if f"{package}.{seam}" not in names] == []


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.repo_name)
def test_code_outside_the_kernel_uses_only_its_face(kernel):
    names, modules = face(kernel), package_modules(kernel)
    found = [violation for path in _outside_files(kernel)
             for violation in face_violations(path.read_text(), str(path.relative_to(REPO_ROOT)),
                                              kernel.repo in path.parents, kernel, names, modules)]
    assert found == []


@pytest.mark.parametrize(("kernel", "source", "kernel_tests"), [
    (RAGGED_DOT, "def test(kernel):\n    kernel.gmm.kernel.scheduled_matmul_call(body)", True),
    (RAGGED_DOT, "def test(kernel):\n    kernel.gmm.tiles.select_config(problem)", True),
    (RAGGED_DOT, "def test(kernel):\n    plan = kernel.gmm.plan\n    plan.interleaved_gated_plan(plan, gate)", True),
    (RAGGED_DOT, "def test(kernel):\n    kernel.gmm(x)", True),
    (RAGGED_DOT, "def test(kernel):\n    getattr(kernel.fused.tiles, 'fused_buffers')", True),
    (RAGGED_DOT, "def test(monkeypatch, kernel):\n    monkeypatch.setattr(kernel.gmm.tiles, 'D_LHS_ROW_TILE', 8)",
     True),
    (RAGGED_DOT, "def f(built):\n    return built.gmm.plan.interleaved_gated_plan(plan, gate)", False),
    (RAGGED_DOT, "def f(built):\n    return built.tgmm.kernel.max_tgmm_items(m, groups, rows)", False),
    (RAGGED_DOT, "def f(built):\n    return built.combine.kernel.combine_schedule(position, live, plan)", False),
    (RAGGED_DOT, "ENTRY = 'gmm.schedule.block_specs'", False),
    (RAGGED_DOT, "def test(kernel):\n    kernel.plan.plan_experts(problem)", True),
    (RAGGED_DOT, "def test(ragged_dot_kernel):\n    ragged_dot_kernel.layer", False),
    (RAGGED_DOT, "def f(built):\n    return built.common.quant.NOT_SERVED", False),
    (RAGGED_DOT, "def test(monkeypatch, kernel):\n    monkeypatch.setattr(kernel.plan, 'FUSED_MAX_TOKENS', 8)", True),
    (RAGGED_DOT, "def test(kernel):\n    getattr(kernel, 'schedule')", True),
    (RAGGED_DOT, "def test(kernel):\n    kernel.reference.no_such_reference", True),
    (RAGGED_DOT, "ragged = kernels['ragged-dot-tpu']\nragged.tiles", False),
    (RAGGED_DOT, "k = get_local_kernel(ragged_dot_build, backend='cpu')\nk.no_such_name", False),
    (RAGGED_DOT, "import pytest\n@pytest.fixture\ndef kernel(ragged_dot_kernel):\n    return ragged_dot_kernel\n"
     "def test(kernel):\n    kernel.no_such_name", False),
    (RAGGED_DOT, "ENTRY = 'layer.experts_layer'", False),
    (RAGGED_DOT, "from ragged_dot_tpu.gmm.kernel import grouped_matmul", False),
    (ATTENTION, "def test(kernel):\n    kernel.flash.kernel.attention_forward(q, k, v, attention)", True),
    (ATTENTION, "def test(kernel):\n    kernel.flash_backward.tiles.window_block_cap(128, True, 'v6e')", True),
    (ATTENTION, "def test(kernel):\n    kernel.common.masking.prepare(q, k, options)", True),
    (ATTENTION, "def test(kernel):\n    kernel.pallas_flash.flash_attention(q, k, v)", True),
    (ATTENTION, "def test(kernel):\n    kernel.flash.tiles.select_config(**shape)", True),
    (ATTENTION, "def f(built):\n    return built.flash.tiles._preferred_blocks(problem, target)", False),
    (ATTENTION, "def test(kernel):\n    kernel.flash_backward.plan.BackwardPlans(problem, dq, dkv)", True),
    (ATTENTION, "def test(kernel):\n    kernel.select_config(**shape)", True),
    (ATTENTION, "attention = kernels['attention-tpu']\nattention.config", False),
    (ATTENTION, "k = get_local_kernel(attention_build, backend='cpu')\nk.no_such_name", False),
    (ATTENTION, "ENTRY = 'attention.attention_forward'", False),
    (ATTENTION, "from attention_tpu.flash.kernel import differentiable_flash_attention", False),
    (RMSNORM, "def test(kernel):\n    kernel.norm.kernel.differentiable_rms_norm(x, weight, 1e-6, 0.0)", True),
    (RMSNORM, "def test(kernel):\n    kernel.rms_norm_forward(x, weight, eps=1e-6)", True),
    (RMSNORM, "def test(kernel):\n    kernel.norm.tiles.OPS['rms_norm']", True),
    (RMSNORM, "def test(kernel):\n    kernel.norm.tiles.select_config(8, 128, dtype)", True),
    (RMSNORM, "def test(kernel):\n    kernel.pallas_rms_norm.rms_norm(x, weight, eps=1e-6)", True),
    (RMSNORM, "def test(kernel):\n    kernel.config.select_config(8, 128, dtype)", True),
    (RMSNORM, "def f(built):\n    return built.norm.plan.RowPlan('rms_norm', 8, 128, 8, 1, None)", False),
    (RMSNORM, "rmsnorm = kernels['rmsnorm-tpu']\nrmsnorm.OPS", False),
    (RMSNORM, "k = get_local_kernel(rmsnorm_build, backend='cpu')\nk.no_such_name", False),
    (RMSNORM, "k = get_local_kernel(kernel_builds['rmsnorm-tpu'], backend='cpu')\nk.OPS", False),
    (RMSNORM, "ENTRY = 'norm.kernel._row_norm'", False),
    (RMSNORM, "from rmsnorm_tpu.norm.tiles import select_config", False),
], ids=lambda value: value.repo_name if isinstance(value, Kernel) else None)
def test_the_check_catches_reaching_past_the_face(kernel, source, kernel_tests):
    assert _violations(kernel, source, kernel_tests)


# Code that stays within each face, in a kernel repo's tests.
WITHIN_THE_FACE = {
    RAGGED_DOT: ("def test(kernel, monkeypatch):\n    config = kernel.gmm.tiles.TileConfig(8, 128, 128)\n"
                 "    plan = kernel.gmm.plan.make(kernel.MatmulProblem(8), config=config)\n"
                 "    kernel.gmm.kernel.call(x, w, sizes, plan)\n"
                 "    kernel.reference.ragged_dot_reference(x)\n    kernel.gmm.tiles.TUNED_TILES.clear()\n"
                 "    getattr(kernel.fused.tiles, 'select')(problem)\n"
                 "    monkeypatch.setattr(kernel.ops, 'check_group_sizes', None)\n"
                 "def other(model, kernel):\n    return model.config.vocab_size, kernel.__name__\n"
                 "def tool(built, plan):\n    return built.combine.plan.make(problem), plan.combine.tiles, built.gmm\n"
                 "ENTRY = 'tgmm.tiles.select'\n"),
    ATTENTION: ("def test(kernel, monkeypatch):\n    kernel.flash.kernel.differentiable_flash_attention(q, k, v, "
                "config=kernel.AttentionConfig(128, 128, 1 << 25))\n"
                "    kernel.reference.reference_attention(q, k, v)\n"
                "    kernel.flash_backward.tiles.select(kernel.Problem.of_shape(**shape))\n"
                "    problem, prepared = kernel.prepare(q, k, kernel.Attention())\n"
                "    kernel.flash.kernel.call(q, k, v, prepared, kernel.flash.plan.make(problem))\n"
                "    tiles = kernel.flash.tiles.ForwardTiles(1, 2048)\n"
                "    monkeypatch.setitem(kernel.flash.tiles.TUNED_TILES, key, tiles)\n"
                "def other(model, kernel):\n    return model.config.vocab_size, kernel.__name__\n"),
    RMSNORM: ("def test(kernel, monkeypatch):\n    kernel.rms_norm(x, weight, 1e-6)\n"
              "    kernel.norm.kernel.rms_norm_forward(x, weight, eps=1e-6, block_rows=16)\n"
              "    problem = kernel.NormProblem('rms_norm', 8, 128, 'float32')\n"
              "    kernel.norm.kernel.call([x], weight, kernel.norm.plan.make(problem), eps=1e-6)\n"
              "    kernel.reference.fused_add_rms_norm(x, residual, weight, 1e-6)\n"
              "    kernel.layers.matching_layer_name(module)\n"
              "    monkeypatch.setitem(kernel.norm.tiles.TUNED_TILES, key, kernel.norm.tiles.RowBlockTiles(1024))\n"
              "def folder(published):\n    build = published.builds['rmsnorm-tpu']\n    return build.rglob('*')\n"
              "def other(model, kernel):\n    return model.config.vocab_size, kernel.__name__\n"),
}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.repo_name)
def test_the_check_passes_code_within_the_face(kernel):
    assert _violations(kernel, WITHIN_THE_FACE[kernel], True) == []
