"""The kernels' faces: what code outside a kernel repo uses of a loaded kernel, and nothing past it.

A kernel package's `__init__.py` lists its face: `__all__`, what a user calls, and `TOOLS`, what this project's
package (tpu_kernels/) and its lab (benchmarks/) use besides. A face name is a name the package binds
(`MatmulProblem`) or a dotted path through the subpackages it binds to one name of a module (`gmm.tiles.select`).
Everything is read from the source with `ast`; nothing is imported. Checked, for ragged-dot-tpu, attention-tpu and
rmsnorm-tpu:

- every face name exists (a dotted one through modules bound by name, as `kernels` needs: see ragged_dot_tpu's
  `__init__.py`), and the package binds nothing at its top level but its face and its modules;
- every TOOLS name is used by the package or the lab: an attribute chain through its path, or a string that names
  it (its path, or its last name where the file reaches its module: `getattr(built.norm.kernel, name)`);
- nothing outside the kernel repos (tpu_kernels/, benchmarks/, tests/) reaches past the face: no import of a kernel
  package's modules or of a name outside its face, no attribute chain that goes through one of its modules outside
  the face to a name that module binds (`x.gmm.tiles.row_chunks`, `x.plan.plan_experts`), unless the path is (or
  leads to) a dotted face name, and no string that names such a path. The kernel's own tests reach its internals,
  and so do the few tests here that hold the lab against them (`LAB_AGAINST_INTERNALS`);
- nothing in a kernel repo imports the lab (it is published without it), and what a build ships (its package and
  benchmarks) imports no tpu_kernels either (a built kernel loads where only `kernels` is installed).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

FACE_LISTS = ("__all__", "TOOLS")  # what a user calls, and what the package and the lab use besides
USERS = ("tpu_kernels", "benchmarks")  # what TOOLS serves
OUTSIDE = (*USERS, "tests")  # what may use only the face


@dataclasses.dataclass(frozen=True)
class Kernel:
    repo_name: str  # its folder under kernel_repos/
    package_name: str

    @property
    def package(self) -> Path:
        return REPO_ROOT / "kernel_repos" / self.repo_name / "torch-ext" / self.package_name

    @property
    def init(self) -> ast.Module:
        return ast.parse((self.package / "__init__.py").read_text())

    def face(self, lists: tuple[str, ...] = FACE_LISTS) -> list[str]:
        assigned = {target.id: ast.literal_eval(node.value) for node in self.init.body if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name) and target.id in FACE_LISTS}
        return [name for listed in lists for name in assigned[listed]]


KERNELS = [Kernel("ragged-dot-tpu", "ragged_dot_tpu"), Kernel("attention-tpu", "attention_tpu"),
           Kernel("rmsnorm-tpu", "rmsnorm_tpu")]
TOOLS_AT_MOST = 50  # names, over the three repos
# Tests that hold the lab against a kernel's internals (its plans, block specs and layout rules, replayed by the
# performance model or compiled): needing both, they can live neither in a kernel repo, published without the lab, nor
# within the face. Each imports the lab and reaches past a face, or leaves this list.
LAB_AGAINST_INTERNALS = ("tests/megacore_cases.py", "tests/test_argument_layouts.py",
                         "tests/test_ragged_dot_quantized_traffic.py", "tests/test_ragged_dot_traffic.py",
                         "tests/test_ragged_dot_vmem_plans.py")
# Where a build takes a kernel repo's Python from: its package and its benchmarks.
SHIPPED_FOLDERS = ("torch-ext", "benchmarks")


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


def _binds_module(kernel: Kernel, parts: list[str]) -> bool:
    """Whether the package `parts[:-1]` (under the kernel's) binds its module `parts[-1]` by an import."""
    init = kernel.package.joinpath(*parts[:-1], "__init__.py")
    return init.exists() and any(alias.name == parts[-1] and node.level == 1 and not node.module
                                 for node in ast.parse(init.read_text()).body if isinstance(node, ast.ImportFrom)
                                 for alias in node.names)


def missing_from_the_package(kernel: Kernel, modules: dict[str, set[str]]) -> list[str]:
    """The face names the package does not bind: a plain one `__init__.py` does not import from a module that binds
    it; a dotted one whose modules are not each bound by name in their package, or whose module does not bind it."""
    sources = {alias.asname or alias.name: (node.module or "", alias.name) for node in kernel.init.body
               if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module for alias in node.names}
    missing = []
    for name in kernel.face():
        parts = name.split(".")
        if len(parts) == 1:
            found = name in sources and sources[name][1] in modules.get(sources[name][0], set())
        else:
            found = (all(_binds_module(kernel, parts[:end]) for end in range(1, len(parts)))
                     and parts[-1] in modules.get(".".join(parts[:-1]), set()))
        if not found and not (len(parts) == 1 and name in modules and _binds_module(kernel, parts)):
            missing.append(name)
    return missing


def bound_past_the_face(kernel: Kernel, modules: dict[str, set[str]]) -> set[str]:
    """What the package's `__init__.py` binds at its top level besides its face and its modules."""
    return _bound_names(kernel.init) - set(kernel.face()) - {name for name in modules if name and "." not in name} - {
        "__all__", "TOOLS", "annotations"}


def _spine(node: ast.Attribute) -> list[ast.Attribute]:
    """The attributes of `a.b.c`, outermost first (a call or subscript at its root ends it)."""
    spine = []
    while isinstance(node, ast.Attribute):
        spine.append(node)
        node = node.value
    return spine


def _chain(node: ast.Attribute) -> list[str]:
    """`a.b.c` as ["b", "c"]."""
    return [attribute.attr for attribute in reversed(_spine(node))]


@dataclasses.dataclass
class Source:
    """What one file says that may name a kernel's parts: its attribute chains (`getattr(x, "a")` and setattr's as
    `x.a`), its strings, and its imports, each with its line."""

    name: str
    chains: list[tuple[int, list[str]]]
    strings: list[tuple[int, str]]
    imports: list[tuple[int, str, list[str]]]  # (line, module, names taken from it; [] for `import module`)

    @classmethod
    def parse(cls, text: str, name: str) -> Source:
        tree = ast.parse(text, name)
        chains, strings, imports, inner = [], [], [], set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner:
                chains.append((node.lineno, _chain(node)))
                inner.update(id(attribute) for attribute in _spine(node))
            elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)
                  and (getattr(node.func, "id", None) in ("getattr", "setattr")
                       or getattr(node.func, "attr", None) in ("setattr", "delattr"))):
                root = _chain(node.args[0]) if isinstance(node.args[0], ast.Attribute) else []
                chains.append((node.lineno, [*root, node.args[1].value]))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append((node.lineno, node.value))
            elif isinstance(node, ast.Import):
                imports += [(node.lineno, alias.name, []) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imports.append((node.lineno, node.module, [alias.name for alias in node.names]))
        return cls(name, chains, strings, imports)


def _sources(folders: tuple[str, ...]) -> list[Source]:
    return [Source.parse(path.read_text(), str(path.relative_to(REPO_ROOT))) for folder in folders
            for path in sorted((REPO_ROOT / folder).rglob("*.py")) if "__pycache__" not in path.parts]


def _holds(chain: list[str], parts: list[str]) -> bool:
    return any(chain[start:start + len(parts)] == parts for start in range(len(chain) - len(parts) + 1))


def uses(source: Source, name: str, package_name: str) -> bool:
    """Whether `source` uses face name `name`: an attribute chain through its path, an import of it, a string of its
    path, or a string of its last name where the file reaches its module (a `getattr` with a name it spells)."""
    parts = name.split(".")
    strings = {text for _, text in source.strings}
    return (any(_holds(chain, parts) for _, chain in source.chains) or name in strings
            or any(module == package_name and name in taken for _, module, taken in source.imports)
            or (parts[-1] in strings and (len(parts) == 1 or any(_holds(chain, parts[:-1])
                                                                   for _, chain in source.chains))))


def past_the_face(source: Source, kernel: Kernel, modules: dict[str, set[str]]) -> list[str]:
    """Each place `source` reaches the kernel past its face, as `file:line: what`."""
    face = kernel.face()
    plain, dotted = {name for name in face if "." not in name}, {name for name in face if "." in name}
    outside_face = {module for module in modules if module and "." not in module} - plain
    found = []
    for line, module, taken in source.imports:
        if module.split(".")[0] == kernel.package_name and (module != kernel.package_name
                                                           or not taken or set(taken) - plain):
            found.append(f"{source.name}:{line}: imports {module} {taken or ''}".rstrip())
    walks = [(line, chain) for line, chain in source.chains]
    walks += [(line, text.split(".")) for line, text in source.strings
              if "." in text and all(part.isidentifier() for part in text.split("."))]
    for line, chain in walks:
        start = 0
        while start < len(chain):  # a path walked from one module is not walked again from its inner modules
            past, walked = _walk(chain[start:], outside_face, dotted, modules)
            if past:
                found.append(f"{source.name}:{line}: .{past} reaches into {kernel.repo_name} past its face")
            start += walked
    return found


def _walk(chain: list[str], outside_face: set[str], dotted: set[str], modules: dict[str, set[str]]) -> tuple[str, int]:
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


@pytest.fixture(scope="module")
def outside() -> list[Source]:
    return _sources(OUTSIDE)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.repo_name)
def test_every_face_name_exists_and_the_package_binds_nothing_past_its_face(kernel):
    modules = package_modules(kernel)
    assert missing_from_the_package(kernel, modules) == []
    assert len(kernel.face()) == len(set(kernel.face()))
    assert bound_past_the_face(kernel, modules) == set()


def test_the_tools_are_at_most_50_names():
    assert sum(len(kernel.face(("TOOLS",))) for kernel in KERNELS) <= TOOLS_AT_MOST


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.repo_name)
def test_every_tool_is_used_by_the_package_or_the_lab(kernel, outside):
    users = [source for source in outside if source.name.split("/")[0] in USERS]
    assert [name for name in kernel.face(("TOOLS",))
            if not any(uses(source, name, kernel.package_name) for source in users)] == []


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda kernel: kernel.repo_name)
def test_nothing_outside_the_kernel_repos_reaches_past_the_face(kernel, outside):
    modules = package_modules(kernel)
    assert [found for source in outside if source.name not in LAB_AGAINST_INTERNALS
            for found in past_the_face(source, kernel, modules)] == []


def test_each_test_of_the_lab_against_internals_takes_both(outside):
    sources = {source.name: source for source in outside}
    for name in LAB_AGAINST_INTERNALS:
        assert any(module.split(".")[0] == "benchmarks" for _, module, _ in sources[name].imports), name
        assert any(past_the_face(sources[name], kernel, package_modules(kernel)) for kernel in KERNELS), name


def test_a_kernel_repo_imports_no_lab_and_ships_no_tpu_kernels_import():
    found = []
    for source in _sources(("kernel_repos",)):
        shipped = source.name.split("/")[2] in SHIPPED_FOLDERS
        found += [f"{source.name}:{line}: imports {module}" for line, module, _ in source.imports
                  if module.split(".")[0] == "benchmarks" or (shipped and module.split(".")[0] == "tpu_kernels")]
    assert found == []


RAGGED_DOT, ATTENTION, RMSNORM = KERNELS


@pytest.mark.parametrize(("kernel", "text"), [
    (RAGGED_DOT, "built.gmm.tiles.row_chunks(rows)"),
    (RAGGED_DOT, "built.plan.plan_experts(problem)"),
    (RAGGED_DOT, "getattr(built.fused.tiles, 'fused_buffers')"),
    (RAGGED_DOT, "monkeypatch.setattr(built.gmm.tiles, 'D_LHS_ROW_TILE', 8)"),
    (RAGGED_DOT, "plan = built.gmm.plan\nplan.gated_plan(plan, gate)"),
    (RAGGED_DOT, "ENTRY = 'gmm.schedule.make_work_items'"),
    (RAGGED_DOT, "from ragged_dot_tpu.gmm.kernel import grouped_matmul"),
    (RAGGED_DOT, "from ragged_dot_tpu import describe_experts"),
    (RAGGED_DOT, "built.common.quant.scheme_of(dtype)"),
    (ATTENTION, "built.flash.tiles.heuristic_config(problem)"),
    (ATTENTION, "built.common.masking.prepare(q, k, options)"),
    (ATTENTION, "ENTRY = 'paged.tiles.PagedConfig'"),
    (RMSNORM, "built.norm.tiles.check_block_rows(8, problem)"),
    (RMSNORM, "import rmsnorm_tpu.norm.kernel"),
], ids=lambda value: value.repo_name if isinstance(value, Kernel) else None)
def test_the_check_finds_a_reach_past_the_face(kernel, text):
    assert past_the_face(Source.parse(text, "example.py"), kernel, package_modules(kernel))


@pytest.mark.parametrize(("kernel", "text"), [
    (RAGGED_DOT, "built.gmm.tiles.select(built.MatmulProblem(8, 128, 128, 2, 'bfloat16', 'bfloat16'), 'v6e')\n"
                 "built.reference.ragged_dot_reference(x)\nbuilt.ops.ragged_dot(x)\ngetattr(built, 'experts_layer')\n"
                 "ENTRY = 'tgmm.tiles.select'\nmodel.config.plan.make(problem)\n"
                 "from ragged_dot_tpu import ragged_dot\n"),
    (ATTENTION, "built.flash.kernel.flash_attention_forward(q, k, v)\nbuilt.Problem.of_shape(**shape)\n"
                "row.paged.tiles\n"),
    (RMSNORM, "getattr(built.norm.kernel, name)\nbuilt.norm.tiles.select(problem, 'v6e').block_rows\n"),
], ids=lambda value: value.repo_name if isinstance(value, Kernel) else None)
def test_the_check_passes_code_within_the_face(kernel, text):
    assert past_the_face(Source.parse(text, "example.py"), kernel, package_modules(kernel)) == []


def test_a_tool_is_used_through_its_path_an_import_or_a_named_getattr():
    assert uses(Source.parse("built.gmm.tiles.select(problem)", "a.py"), "gmm.tiles.select", "ragged_dot_tpu")
    assert uses(Source.parse("NAME = 'experts_layer'\ngetattr(built, NAME)", "a.py"), "experts_layer", "ragged_dot_tpu")
    assert uses(Source.parse("NAMES = {'a': 'rms_norm_forward'}\ngetattr(built.norm.kernel, NAMES[a])", "a.py"),
                "norm.kernel.rms_norm_forward", "rmsnorm_tpu")
    assert not uses(Source.parse("NAMES = {'a': 'rms_norm_forward'}", "a.py"), "norm.kernel.rms_norm_forward",
                    "rmsnorm_tpu")
    assert not uses(Source.parse("built.tgmm.tiles.select(problem)", "a.py"), "gmm.tiles.select", "ragged_dot_tpu")
