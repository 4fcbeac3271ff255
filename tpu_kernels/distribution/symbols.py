"""symbols.json of a build variant: the public functions and layers `kernels describe-api` lists.

kernels 0.19 reads `<variant>/symbols.json` (schema_version 1) to describe a kernel without
importing it. kernel-builder writes it by importing the built package; importing ours loads jax
and torch, so here it is read from the source instead, with `ast`, and nothing is imported:

* `functions`: the names in the package's `__all__` that are functions (a `def`, `async def` or a
  lambda), followed through the package's own imports and aliases (`from .ops import rms_norm`);
  submodules, classes and data are left out, and so are names starting with `_`, `layers`, and
  anything defined in a `_private_for_testing` module;
* `layers`: the classes in the `__all__` of the package's `layers` module (if it has one), each with
  `attributes`: `has_backward` and `can_torch_compile` as the class body sets them (True/False), or
  null when the body does not set them to a bool literal.

Each symbol has `name`, `qualname`, `module`, `kind` ("function" or "class"), `doc` (the cleaned
docstring, or null) and `signature`: its parameters (`name`, `kind` as `inspect.Parameter.kind`
names it, `default` as written in the source, `annotation` as the source text of the type (a string
annotation as the text it holds), or null) and `return_annotation`. (kernel-builder, which imports,
writes a default's repr, and under `from __future__ import annotations` an annotation's repr: quoted.)
A class's signature is its `__init__`'s without `self`, or null when the class defines none (a
kernels layer must not). `module` is the dotted name under the package's Python name. Nothing is
inherited: a class without a docstring has a null `doc`, and a layer flag set only by a base class
is null.

A name in `__all__` that the package does not bind, or binds by importing it from another library,
is an error: its kind cannot be told without importing. The output depends on the source files
only: same sources, same bytes.

Standard library only.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYMBOLS_FILE = "symbols.json"
SCHEMA_VERSION = 1
LAYERS_MODULE = "layers"
PRIVATE_FOR_TESTING = "_private_for_testing"
LAYER_ATTRIBUTES = ("has_backward", "can_torch_compile")

_FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)


class SymbolsError(ValueError):
    """The package's public names cannot be described from its source."""


def symbols_json(package_dir: Path, python_name: str) -> str:
    """The text of symbols.json for the package at `package_dir` (imported as `python_name`)."""
    return json.dumps(describe_package(package_dir, python_name), indent=2, ensure_ascii=False) + "\n"


def describe_package(package_dir: Path, python_name: str) -> dict[str, Any]:
    """symbols.json's content for the package at `package_dir`, read from its source."""
    package = _Package(Path(package_dir), python_name)
    init = package.module(())
    if init is None:
        raise SymbolsError(f"{package_dir}: no __init__.py")
    functions = [symbol for symbol in package.exports(init) if symbol["kind"] == "function"]
    layers_module = package.module((LAYERS_MODULE,))
    layers = []
    if layers_module is not None:
        layers = [symbol for symbol in package.exports(layers_module) if symbol["kind"] == "class"]
    return {"schema_version": SCHEMA_VERSION, "module": python_name, "functions": functions, "layers": layers}


@dataclass
class _Module:
    """One module of the package: its path (`parts` below the package) and its top-level bindings."""

    parts: tuple[str, ...]
    path: Path
    is_package: bool
    # name -> the statement that binds it last in source order (with the alias, for imports).
    bindings: dict[str, tuple[ast.AST, ast.alias | None]] = field(default_factory=dict)
    star_imports: list[ast.ImportFrom] = field(default_factory=list)
    all_node: ast.AST | None = None
    all_names: list[str] | None = None


class _Package:
    def __init__(self, root: Path, python_name: str):
        self.root = root
        self.python_name = python_name
        self._modules: dict[tuple[str, ...], _Module | None] = {}

    def dotted(self, module: _Module) -> str:
        return ".".join((self.python_name, *module.parts))

    def module(self, parts: tuple[str, ...]) -> _Module | None:
        """The package's module at `parts` (() for the package itself), or None if there is none."""
        if parts not in self._modules:
            folder = self.root.joinpath(*parts)
            candidates = [(folder / "__init__.py", True)]
            if parts:
                candidates.append((folder.with_suffix(".py"), False))
            found = next(((path, is_package) for path, is_package in candidates if path.is_file()), None)
            self._modules[parts] = self._parse(parts, *found) if found else None
        return self._modules[parts]

    def _parse(self, parts: tuple[str, ...], path: Path, is_package: bool) -> _Module:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as error:
            raise SymbolsError(f"{path}: cannot be parsed: {error}") from None
        except (RecursionError, MemoryError):
            raise SymbolsError(f"{path}: cannot be parsed: it nests too deeply") from None
        module = _Module(parts, path, is_package)
        for statement in _top_level(tree.body):
            self._bind(module, statement)
        return module

    def _bind(self, module: _Module, statement: ast.stmt) -> None:
        if isinstance(statement, (*_FUNCTION_NODES, ast.ClassDef)):
            module.bindings[statement.name] = (statement, None)
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                module.bindings[alias.asname or alias.name.split(".")[0]] = (statement, alias)
        elif isinstance(statement, ast.ImportFrom):
            for alias in statement.names:
                if alias.name == "*":
                    module.star_imports.append(statement)
                else:
                    module.bindings[alias.asname or alias.name] = (statement, alias)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    if target.id == "__all__":
                        self._bind_all(module, statement)
                    elif not isinstance(statement, ast.AugAssign) and statement.value is not None:
                        module.bindings[target.id] = (statement, None)
                else:  # unpacking binds its names; `f.attr = ...` and `d[k] = ...` bind none
                    for name in _unpacked_names(target):
                        module.bindings[name] = (statement, None)

    def _bind_all(self, module: _Module, statement: ast.Assign | ast.AnnAssign | ast.AugAssign) -> None:
        names = _literal_strings(statement.value)
        if names is None or (isinstance(statement, ast.AugAssign) and not isinstance(statement.op, ast.Add)):
            raise SymbolsError(f"{module.path}:{statement.lineno}: __all__ must be a literal list or tuple of strings "
                               "(assigned, or extended with +=) to be read without importing the package")
        if isinstance(statement, ast.AugAssign):
            if module.all_names is None:
                raise SymbolsError(f"{module.path}:{statement.lineno}: __all__ extended before it is assigned")
            module.all_names = module.all_names + names
        else:
            module.all_names = names
        module.all_node = statement

    def exports(self, module: _Module) -> list[dict[str, Any]]:
        """The functions and classes `module.__all__` names, in its order, described."""
        symbols = []
        for name in dict.fromkeys(module.all_names or ()):
            if name.startswith("_") or name == LAYERS_MODULE:
                continue
            found = self._resolve(module, name, set())
            if found is None:
                raise SymbolsError(f"{module.path}: __all__ names {name!r}, which the module does not define")
            owner, node = found
            if not isinstance(node, (*_FUNCTION_NODES, ast.ClassDef, ast.Lambda)):
                continue  # a submodule, or data
            if PRIVATE_FOR_TESTING in owner.parts:
                continue
            symbols.append(self._describe(name, owner, node))
        return symbols

    def _resolve(self, module: _Module, name: str, seen: set) -> tuple[_Module, ast.AST] | None:
        """(module defining it, its def/class/lambda node, or another node for a module or data), None if unbound."""
        key = (module.parts, name)
        if key in seen:
            raise SymbolsError(f"{module.path}: {name!r} is imported in a cycle")
        seen = seen | {key}
        binding = module.bindings.get(name)
        if binding is None:
            submodule = self.module((*module.parts, name)) if module.is_package else None
            if submodule is not None:
                return submodule, ast.Module(body=[], type_ignores=[])  # `pkg.sub` once imported anywhere
            for star in module.star_imports:
                target = self._import_target(module, star)
                if target is not None and (name in (target.all_names or ()) or (
                        target.all_names is None and not name.startswith("_"))):
                    found = self._resolve(target, name, seen)
                    if found is not None:
                        return found
            return None
        node, alias = binding
        if isinstance(node, ast.Import):
            return module, node  # a module
        if isinstance(node, ast.ImportFrom):
            target = self._import_target(module, node)
            if target is None:
                raise SymbolsError(
                    f"{module.path}:{node.lineno}: {name!r} comes from {'.' * node.level}{node.module or ''}, outside "
                    "the package: export only what the package defines, or its kind cannot be told without "
                    "importing it")
            submodule = self.module((*target.parts, alias.name)) if target.is_package else None
            if submodule is not None:
                return submodule, ast.Module(body=[], type_ignores=[])  # `from . import ops`
            found = self._resolve(target, alias.name, seen)
            if found is None:
                raise SymbolsError(f"{target.path}: {alias.name!r}, imported by {module.path}:{node.lineno}, "
                                   "is not defined there")
            return found
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            if isinstance(value, ast.Lambda):
                return module, value
            if isinstance(value, (ast.Name, ast.Attribute)):
                return self._resolve_expression(module, value, seen) or (module, node)
            return module, node  # data, or an object a call made
        return module, node

    def _resolve_expression(self, module: _Module, expression: ast.expr, seen: set):
        """What `name` or `module_name.attribute` refers to, when the package defines it; else None."""
        if isinstance(expression, ast.Name):
            return self._resolve(module, expression.id, seen)
        if isinstance(expression, ast.Attribute):
            base = self._resolve_expression(module, expression.value, seen)
            if base is not None and isinstance(base[1], ast.Module):
                return self._resolve(base[0], expression.attr, seen)
        return None

    def _import_target(self, module: _Module, node: ast.ImportFrom) -> _Module | None:
        """The package's module that `from ... import` reads from, or None when it is another library's."""
        if node.level == 0:
            parts = tuple((node.module or "").split("."))
            if parts[0] != self.python_name:
                return None
            base: tuple[str, ...] = ()
            parts = parts[1:]
        else:
            base = module.parts if module.is_package else module.parts[:-1]
            if node.level - 1 > len(base):
                return None
            base = base[:len(base) - (node.level - 1)]
            parts = tuple(node.module.split(".")) if node.module else ()
        return self.module(base + parts)

    def _describe(self, name: str, owner: _Module, node: ast.AST) -> dict[str, Any]:
        is_class = isinstance(node, ast.ClassDef)
        symbol: dict[str, Any] = {
            "name": name,
            "qualname": "<lambda>" if isinstance(node, ast.Lambda) else node.name,
            "module": self.dotted(owner),
            "kind": "class" if is_class else "function",
            "doc": None if isinstance(node, ast.Lambda) else ast.get_docstring(node, clean=True),
            "signature": _class_signature(node) if is_class else _signature(node.args, getattr(node, "returns", None)),
        }
        if is_class:
            assigned = _class_assignments(node)
            symbol["attributes"] = {
                attribute: value.value if isinstance(value := assigned.get(attribute), ast.Constant)
                and isinstance(value.value, bool) else None
                for attribute in LAYER_ATTRIBUTES
            }
        return symbol


def _top_level(body: list[ast.stmt]):
    """The module's statements in source order, those inside if/try/with blocks included."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If):
            yield from _top_level(statement.body)
            yield from _top_level(statement.orelse)
        elif isinstance(statement, ast.Try) or type(statement).__name__ == "TryStar":
            yield from _top_level(statement.body)
            for handler in statement.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(statement.orelse)
            yield from _top_level(statement.finalbody)
        elif isinstance(statement, (ast.With, ast.AsyncWith)):
            yield from _top_level(statement.body)


def _unpacked_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Starred):
        return _unpacked_names(target.value)
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for item in target.elts for name in _unpacked_names(item)]
    return []


def _literal_strings(node: ast.expr | None) -> list[str] | None:
    if not isinstance(node, (ast.List, ast.Tuple)):
        return None
    if not all(isinstance(item, ast.Constant) and isinstance(item.value, str) for item in node.elts):
        return None
    return [item.value for item in node.elts]


def _source(node: ast.expr | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _annotation(node: ast.expr | None) -> str | None:
    """The annotation as source text; a string annotation (`"Tensor"`) as the text it holds, as under
    `from __future__ import annotations`, where every annotation is that text."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return _source(node)


def _signature(arguments: ast.arguments, returns: ast.expr | None, *, skip_first: bool = False) -> dict[str, Any]:
    positional = [(arg, "POSITIONAL_ONLY") for arg in arguments.posonlyargs]
    positional += [(arg, "POSITIONAL_OR_KEYWORD") for arg in arguments.args]
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    parameters = [(arg, kind, default) for (arg, kind), default in zip(positional, defaults)]
    if arguments.vararg is not None:
        parameters.append((arguments.vararg, "VAR_POSITIONAL", None))
    parameters += [(arg, "KEYWORD_ONLY", default) for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults)]
    if arguments.kwarg is not None:
        parameters.append((arguments.kwarg, "VAR_KEYWORD", None))
    if skip_first and parameters and parameters[0][1] in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD"):
        parameters = parameters[1:]
    return {
        "parameters": [
            {"name": arg.arg, "kind": kind, "default": _source(default), "annotation": _annotation(arg.annotation)}
            for arg, kind, default in parameters
        ],
        "return_annotation": _annotation(returns),
    }


def _class_signature(node: ast.ClassDef) -> dict[str, Any] | None:
    init = next((item for item in node.body if isinstance(item, _FUNCTION_NODES) and item.name == "__init__"), None)
    if init is None:
        return None
    return _signature(init.args, None, skip_first=True)


def _class_assignments(node: ast.ClassDef) -> dict[str, ast.expr]:
    """name -> value of the class body's plain assignments (the last one wins)."""
    assigned = {}
    for statement in node.body:
        if isinstance(statement, ast.Assign):
            for target in statement.targets:
                if isinstance(target, ast.Name):
                    assigned[target.id] = statement.value
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
            assigned[statement.target.id] = statement.value
    return assigned
