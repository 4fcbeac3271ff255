"""symbols.json, read statically from a kernel's source at build time: the same description as importing the
package gives (tests/runtime_symbols.py, kernel-builder's way), and what `kernels describe-api` lists."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.distribution.symbols import SymbolsError, describe_package, symbols_json

from .conftest import REPO_ROOT
from .runtime_symbols import describe_module

KERNEL_NAMES = ("ragged-dot-tpu", "rmsnorm-tpu", "attention-tpu")
BIN = Path(sys.executable).parent

SAMPLE = {
    "__init__.py": '''
        """A package exporting every kind of name."""
        from __future__ import annotations

        import json

        from . import ops
        from ._private_for_testing.helpers import hidden
        from .decorated import wrapped
        from .nested.deep import deep_function
        from .ops import scale, shift as moved

        CONSTANT = (1, 2)
        alias = ops.scale
        square = lambda x, /, power=2: x ** power
        made = ops.make()


        def local(a, /, b: int = None, *args: float, c="é", **kwargs) -> None:
            """Local function.

                Indented line.
            """


        async def later(x: list[int] | None) -> dict[str, int]:
            return {}


        class NotAFunction:
            """A class."""


        ops.scale.tag = 1  # sets an attribute: binds no name

        if CONSTANT:
            def conditional(*, flag: bool = False):
                pass

        __all__ = ["CONSTANT", "json", "ops", "scale", "moved", "deep_function", "hidden", "wrapped", "alias",
                   "square", "made", "local", "later", "NotAFunction", "_private", "layers"]
        __all__ += ["conditional", "local"]
        _private = 1
    ''',
    "ops.py": '''
        from __future__ import annotations


        def scale(x: float, factor: float = 2.0) -> float:
            """Scale x."""
            return x * factor


        def shift(x, by=-1):
            return x + by


        def make():
            return {"made": True}
    ''',
    "decorated.py": '''
        import functools


        def logged(function):
            @functools.wraps(function)
            def wrapper(*args, **kwargs):
                return function(*args, **kwargs)
            return wrapper


        @logged
        def wrapped(value: "int", *, twice: bool = True) -> "int":
            """A decorated function."""
            return value
    ''',
    "nested/__init__.py": "",
    "nested/deep.py": '''
        def deep_function(x=(1, "two", None)):
            """From a subpackage."""
    ''',
    "_private_for_testing/__init__.py": "",
    "_private_for_testing/helpers.py": '''
        def hidden():
            pass
    ''',
    "layers.py": '''
        class Flagged:
            """Backward and no compile."""

            has_backward = True
            can_torch_compile = False


        class Unflagged:
            """Flags that are not bools."""

            has_backward = "yes"


        class WithInit:
            """A class with a constructor."""

            def __init__(self, size: int = 4, *, name="x"):
                self.size = size


        def helper():
            pass


        __all__ = ["Flagged", "Unflagged", "WithInit", "helper"]
    ''',
}


def write_package(root: Path, name: str, files: dict[str, str]) -> Path:
    package = root / name
    for relative, text in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return package


def test_the_static_reading_gives_what_importing_gives(tmp_path, monkeypatch):
    name = f"symbols_sample_{os.urandom(4).hex()}"
    package = write_package(tmp_path, name, SAMPLE)
    static = describe_package(package, name)
    assert [symbol["name"] for symbol in static["functions"]] == [
        "scale", "moved", "deep_function", "wrapped", "alias", "square", "local", "later", "conditional"]
    assert [(layer["name"], layer["attributes"]) for layer in static["layers"]] == [
        ("Flagged", {"has_backward": True, "can_torch_compile": False}),
        ("Unflagged", {"has_backward": None, "can_torch_compile": None}),
        ("WithInit", {"has_backward": None, "can_torch_compile": None})]

    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        imported = importlib.import_module(name)
        assert describe_module(imported) == static
    finally:
        for module in [module for module in sys.modules if module == name or module.startswith(name + ".")]:
            del sys.modules[module]
    assert json.loads(symbols_json(package, name)) == static


@pytest.mark.parametrize("files, error", [
    ({"__init__.py": "from torch import relu\n__all__ = ['relu']\n"}, "'relu' comes from torch, outside the package"),
    ({"__init__.py": "__all__ = ['missing']\n"}, "__all__ names 'missing', which the module does not define"),
    ({"__init__.py": "from .ops import gone\n__all__ = ['gone']\n", "ops.py": "def here(): pass\n"},
     "'gone', imported by .*__init__.py:1, is not defined there"),
    ({"__init__.py": "NAMES = ['f']\n__all__ = NAMES\n"}, "__all__ must be a literal list or tuple of strings"),
    ({"__init__.py": "__all__ = ['f', 1]\n"}, "__all__ must be a literal list or tuple of strings"),
    ({"__init__.py": "def f(:\n"}, "cannot be parsed"),
])
def test_what_cannot_be_told_without_importing_is_an_error(tmp_path, files, error):
    with pytest.raises(SymbolsError, match=error):
        describe_package(write_package(tmp_path, "pkg", files), "pkg")


def test_a_package_without_all_or_layers_exports_nothing(tmp_path):
    package = write_package(tmp_path, "pkg", {"__init__.py": "def f(): pass\n"})
    assert describe_package(package, "pkg") == {"schema_version": 1, "module": "pkg", "functions": [], "layers": []}


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("builds")
    return {name: build_kernel_repo(REPO_ROOT / "kernel_repos" / name, out) for name in KERNEL_NAMES}


def test_every_variant_carries_the_same_symbols_json_in_its_digest(builds):
    for name, build in builds.items():
        python_name = name.replace("-", "_")
        expected = symbols_json(REPO_ROOT / "kernel_repos" / name / "torch-ext" / python_name, python_name)
        for variant in ("torch-cpu", "torch-tpu"):
            assert (build / "build" / variant / "symbols.json").read_text() == expected
            metadata = json.loads((build / "build" / variant / "metadata.json").read_text())
            assert "symbols.json" in metadata["digest"]["files"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_our_kernels_symbols_match_the_imported_packages(builds):
    """kernels loads each build (jax included) in another process; the oracle inspects what it imported."""
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("runtime_symbols.py")),
                             *map(str, builds.values())], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr[-4000:]
    imported = json.loads(result.stdout)
    for name, build in builds.items():
        python_name = name.replace("-", "_")
        described = imported[str(build)]
        # kernels imports a variant under its metadata id: put the package's own name back.
        module_id = described["module"]
        described = json.loads(json.dumps(described).replace(f'"{module_id}', f'"{python_name}'))
        static = json.loads((build / "build" / "torch-cpu" / "symbols.json").read_text())
        assert described == as_imported(static), name


def as_imported(described: dict) -> dict:
    """`described` with each default written as the imported package's repr of it: symbols.json gives a default
    as the source spells it (`float('inf')` where importing gives `inf`)."""
    described = json.loads(json.dumps(described))
    for symbol in described["functions"] + described["layers"]:
        for parameter in (symbol["signature"] or {}).get("parameters", []):
            if parameter["default"] is not None:
                try:
                    parameter["default"] = repr(eval(parameter["default"], {"__builtins__": {"float": float}}))
                except NameError:
                    pass  # a name of the kernel's module: left as written
    return described


EXPECTED_API = {
    "ragged-dot-tpu": (["experts_forward", "gated_experts", "ragged_dot"], []),
    "rmsnorm-tpu": (["fused_add_rms_norm", "rms_norm"], ["RMSNorm", "RMSNormZeroCentered"]),
    "attention-tpu": (["supports_head_dims", "attention_forward", "attention_mask", "flash_attention",
                       "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                       "ragged_paged_attention", "ragged_varlen_attention", "latent_attention",
                       "latent_attention_forward", "serve_latent", "latent_refusal"], []),
}


def describe_api_text(functions: list[str], layers: list[str]) -> list[str]:
    """The Functions and Layers sections of `kernels describe-api` for these names (our layers set both flags)."""
    return (["Functions:"] + [f"  {name}" for name in functions] + ["Layers:"]
            + ([f"  {name}  has_backward=True  can_torch_compile=True" for name in layers] or ["  (none)"]))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_kernels_describe_api_lists_our_functions_and_layers(builds, name):
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "KERNELS_"))}
    result = subprocess.run([str(BIN / "kernels"), "describe-api", str(builds[name])], capture_output=True, text=True,
                            timeout=180, env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "NO_COLOR": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[:2] == [f"Path: {builds[name]}", "Variant: torch-cpu"]
    assert lines[2:] == describe_api_text(*EXPECTED_API[name])


def test_a_symbols_json_in_the_source_is_refused(tmp_path):
    repo = tmp_path / "rmsnorm-tpu"
    shutil.copytree(REPO_ROOT / "kernel_repos" / "rmsnorm-tpu", repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "torch-ext" / "rmsnorm_tpu" / "symbols.json").write_text("{}")
    with pytest.raises(ValueError, match="the build writes symbols.json; remove this one"):
        build_kernel_repo(repo, tmp_path / "out")
    assert not (tmp_path / "out").exists()
