"""The wheel is the product: runtime, distribution, integration, aot, cli, disk cache and pytest plugin, not the lab.

The wheel is built from a copy of the package's own files, then installed without dependencies into a fresh venv
that sees this venv's packages except the lab's own (matplotlib, tokamax) and our editable install.
"""

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

LAB_ONLY_PACKAGES = ("matplotlib", "mpl_toolkits", "tokamax")
# What the product must not carry: jax's private modules, pip run to fetch code, an import of the lab (it runs from
# a checkout, as `python -m benchmarks`), by a statement or by name.
FORBIDDEN = re.compile(r"jax\._src|pip download|^\s*(from|import) benchmarks\b|[\"']benchmarks\.", re.MULTILINE)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    shutil.copytree(REPO_ROOT / "tpu_kernels", source / "tpu_kernels",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(source)], check=True, capture_output=True, timeout=300)
    (built,) = out.glob("tpu_kernels-*.whl")
    return built


@pytest.mark.multiprocess
def test_the_wheel_holds_the_product_and_nothing_of_the_lab(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        sources = {name: archive.read(name).decode() for name in names if name.endswith(".py")}
    packages = {name.split("/")[1] for name in names if name.startswith("tpu_kernels/") and name.count("/") > 1}
    assert packages == {"distribution", "integration", "runtime"}, packages
    assert not [name for name in names if "/bench/" in name or "/perf/" in name or name.startswith("benchmarks/")]
    assert not {name: match.group() for name, source in sources.items() if (match := FORBIDDEN.search(source))}


def _fresh_venv_without_the_lab(root: Path) -> Path:
    """A venv whose site-packages sees this venv's packages but the lab's and tpu_kernels' own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    shared = root / "shared-packages"
    shared.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        name = entry.name.lower()
        if name.startswith(LAB_ONLY_PACKAGES) or "tpu_kernels" in name or name.endswith(".pth"):
            continue
        (shared / entry.name).symlink_to(entry)
    (site / "shared-packages.pth").write_text(f"{shared}\n")
    return python


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kernelize_imports_from_the_wheel_without_the_labs_dependencies(wheel, tmp_path):
    python = _fresh_venv_without_the_lab(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    code = (
        "import importlib.util, json, sys\n"
        "import tpu_kernels\n"
        "from tpu_kernels import kernelize, get_kernel\n"
        "from tpu_kernels.cli import main\n"
        f"lab = {{name: importlib.util.find_spec(name) is not None for name in {(*LAB_ONLY_PACKAGES, 'benchmarks')!r}}}\n"
        "try:\n"
        "    main(['bench', '--help'])\n"
        "except SystemExit as exit_:\n"
        "    status = exit_.code\n"
        "print(json.dumps({'file': tpu_kernels.__file__, 'lab': lab, 'bench': status}))\n"
    )
    result = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(tmp_path / "venv")), report
    assert not any(report["lab"].values()), report
    # The product's command line carries no lab command: the lab runs from a checkout (`python -m benchmarks`).
    assert report["bench"] == 2
    assert "invalid choice: 'bench'" in result.stderr
