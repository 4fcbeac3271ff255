"""What a kernel's symbols.json says when it is written by importing the package, as kernel-builder does:
the oracle that the builder's static reading (tpu_kernels.distribution.symbols) is checked against.

`describe_module(package)` inspects an imported package: the functions its `__all__` names
(inspect.isfunction), and the classes the `__all__` of its `layers` submodule names, with
`inspect.signature`, `inspect.getdoc` and the layer attributes read from the class. Names starting
with `_`, `layers`, and symbols of a `_private_for_testing` module are left out.

As a script, `python runtime_symbols.py BUILD...` loads each kernel build's torch-cpu variant
with `kernels.get_local_kernel` and prints {build: description} as JSON (this imports jax and torch).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path


def describe_module(package) -> dict:
    layers = getattr(package, "layers", None)
    if layers is None:
        try:
            layers = importlib.import_module(f"{package.__name__}.layers")
        except ModuleNotFoundError as error:
            if error.name != f"{package.__name__}.layers":
                raise
    return {
        "schema_version": 1,
        "module": package.__name__,
        "functions": _exports(package, inspect.isfunction),
        "layers": _exports(layers, inspect.isclass) if inspect.ismodule(layers) else [],
    }


def _exports(module, predicate) -> list[dict]:
    symbols = []
    for name in dict.fromkeys(getattr(module, "__all__", ())):
        if name.startswith("_") or name == "layers":
            continue
        value = getattr(module, name)
        if not predicate(value) or "_private_for_testing" in value.__module__.split("."):
            continue
        symbol = {
            "name": name,
            "qualname": value.__qualname__,
            "module": value.__module__,
            "kind": "class" if inspect.isclass(value) else "function",
            "doc": inspect.getdoc(value),
            "signature": _signature(value),
        }
        if inspect.isclass(value):
            symbol["attributes"] = {
                attribute: flag if isinstance(flag := getattr(value, attribute, None), bool) else None
                for attribute in ("has_backward", "can_torch_compile")
            }
        symbols.append(symbol)
    return symbols


def _signature(value) -> dict | None:
    if inspect.isclass(value) and "__init__" not in vars(value):
        return None  # what the static reading gives a class without its own __init__ (a kernels layer)
    signature = inspect.signature(value, eval_str=False)

    def text(annotation_or_default, empty, as_default=False):
        if annotation_or_default is empty:
            return None
        if as_default:
            return repr(annotation_or_default)
        # Under `from __future__ import annotations` an annotation is the source text already.
        return annotation_or_default if isinstance(annotation_or_default, str) else inspect.formatannotation(
            annotation_or_default)

    return {
        "parameters": [
            {"name": parameter.name, "kind": parameter.kind.name,
             "default": text(parameter.default, inspect.Parameter.empty, as_default=True),
             "annotation": text(parameter.annotation, inspect.Parameter.empty)}
            for parameter in signature.parameters.values()
        ],
        "return_annotation": None if inspect.isclass(value) else text(signature.return_annotation,
                                                                       inspect.Signature.empty),
    }


if __name__ == "__main__":
    import kernels

    described = {}
    for build in sys.argv[1:]:
        package = kernels.get_local_kernel(Path(build), backend="cpu")
        described[build] = describe_module(package)
    print(json.dumps(described))
