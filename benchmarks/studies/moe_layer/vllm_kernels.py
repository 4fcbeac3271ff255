"""vLLM's TPU kernels, loaded from its wheel without the serving engine: its grouped matmul
(`tpu_inference.kernels.megablox.gmm`) and its fused expert-parallel MoE kernel
(`tpu_inference.kernels.fused_moe.v1.kernel.fused_ep_moe`).

The `tpu-inference` package pins jax 0.11.2 and its `__init__` imports vllm,
so it is not installed. Each kernel module imports only jax, its own tuned
table (`tuned_block_sizes.py`) and `tpu_inference.logger` (which imports
vllm): those files are read from the pinned wheel and run as modules of their
own names, with a stand-in logger. The wheel is fetched once from the package
index into the benchmark's cache and checked against WHEEL_SHA256 before any
of it runs: a different file is refused.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import types
import zipfile
from pathlib import Path

from tpu_kernels.disk_cache import cache_root, private_folder

WHEEL_REQUIREMENT = "tpu-inference==0.32.0"
WHEEL_NAME = "tpu_inference-0.32.0-py3-none-any.whl"
WHEEL_SHA256 = "7c25a3c76cefd383f06ef115a6ed4d7bed82c081f047046bfef55f5913ea06d4"
# Per kernel, its modules in import order: each imports only jax and the ones before it (and the logger).
GMM_MODULES = ("tpu_inference.kernels.megablox.common", "tpu_inference.kernels.megablox.tuned_block_sizes",
               "tpu_inference.kernels.megablox.gmm")
FUSED_MOE_MODULES = ("tpu_inference.kernels.fused_moe.v1.tuned_block_sizes",
                     "tpu_inference.kernels.fused_moe.v1.kernel")
DEFAULT_FOLDER = cache_root("wheels")


def wheel(folder: Path) -> Path:
    """The pinned wheel in `folder`, downloaded (without dependencies) if absent; refused unless its hash matches."""
    folder = private_folder(folder)  # no other user can swap the wheel after its hash is checked
    path = folder / WHEEL_NAME
    if not path.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "--dest", str(folder), WHEEL_REQUIREMENT], check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{path} has sha256 {digest}, not the pinned {WHEEL_SHA256}: refusing to run its code")
    return path


class _StandInLogger(logging.LoggerAdapter):
    """vllm's logger as the gmm module uses it (`warning_once`), on the standard library."""

    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})
        self._said: set[str] = set()

    def warning_once(self, message: str, *args) -> None:
        if message not in self._said:
            self._said.add(message)
            self.warning(message, *args)


def load_gmm(folder: Path):
    """vLLM's `gmm` function (its tuned table inside), from the pinned wheel in `folder`."""
    return load_modules(folder, GMM_MODULES).gmm


def load_fused_moe(folder: Path):
    """vLLM's fused MoE kernel module (`fused_ep_moe`, its reference `ref_moe`), from the pinned wheel in `folder`."""
    return load_modules(folder, FUSED_MOE_MODULES)


def load_fused_moe_tuning(folder: Path):
    """The fused kernel's block-size module (`TUNED_BLOCK_SIZES`, `get_tuned_block_sizes`), from the same wheel."""
    return load_modules(folder, FUSED_MOE_MODULES[:1])


def load_modules(folder: Path, modules: tuple[str, ...]) -> types.ModuleType:
    """The last of `modules` (and the ones before it) run from the pinned wheel, under stand-in parent packages."""
    if modules[-1] in sys.modules:
        return sys.modules[modules[-1]]
    if "tpu_inference" in sys.modules and not hasattr(sys.modules["tpu_inference"], "_stand_in"):
        raise RuntimeError("a real tpu_inference package is imported: vLLM's kernels are loaded from its wheel only")
    with zipfile.ZipFile(wheel(folder)) as archive:
        sources = {name: archive.read(name.replace(".", "/") + ".py").decode() for name in modules}
    parents = {name.rsplit(".", depth)[0] for name in modules for depth in range(1, name.count(".") + 1)}
    for name in sorted(parents):
        package = types.ModuleType(name)
        package.__path__ = []
        package._stand_in = True
        sys.modules.setdefault(name, package)
    logger = types.ModuleType("tpu_inference.logger")
    logger.init_logger = _StandInLogger
    sys.modules.setdefault("tpu_inference.logger", logger)
    for name in modules:
        module = types.ModuleType(name)
        module.__file__ = f"{WHEEL_NAME}/{name.replace('.', '/')}.py"
        sys.modules[name] = module
        exec(compile(sources[name], module.__file__, "exec"), module.__dict__)  # noqa: S102 - the pinned wheel
    return sys.modules[modules[-1]]
