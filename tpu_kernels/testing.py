"""pytest plugin (entry point `tpu_kernels`): a `kernel` fixture for kernel repo tests.

A kernel repo's tests run against its *built* torch-cpu variant, loaded with
`tpu_kernels.distribution.loader.get_local_kernel` (`kernels.get_local_kernel` after the digest
check), as a user would load it. The variant is built once per session into a
temp dir, or taken from TPU_KERNELS_BUILT (set by `tpu-kernels check`). The
loader keeps one module per kernel content, so every test in a session that
loads the same kernel gets the same module: two copies of one kernel id in a
process re-register its torch ops and confuse torch.compile's guards.

Race detection of the TPU interpreter is on for a session whose pytest
configuration says `tpu_kernels_detect_races = true` (this project's
pyproject.toml does; `tpu-kernels check` passes it on the command line).
Installing the package changes no other project's test runs.

Kernel repo tests also take helpers from here: `interpret` (a JAX function
of the kernel in TPU interpret mode, failing on a data race), `no_kernel_if`
(an empty input must run no Pallas kernel), `assert_matches` (a result
against the reference, relative to the reference's scale), `dimensions` (a
hypothesis strategy of sizes that are often 0), `tiny_transformers_model`
(a small seeded transformers model to swap kernels into), and the checks that
a kernel keeps the project's shared policies: `assert_vmem_policy` (its VMEM
budget and limit are `runtime.hardware`'s), `assert_tuned_table` (its tuned
tiles table has `runtime.tuning`'s one form and is what it selects) and
`assert_generation_resolved_once` (its JAX functions resolve their generation
by `runtime.hardware`'s one rule).
"""

from __future__ import annotations

import io
import os
import sys
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from unittest import mock

import pytest

BUILT_ENV = "TPU_KERNELS_BUILT"
DETECT_RACES_INI = "tpu_kernels_detect_races"


def pytest_addoption(parser):
    parser.addini(DETECT_RACES_INI, "run Pallas kernels in interpret mode with race detection", type="bool", default=False)


def pytest_configure(config):
    if config.getini(DETECT_RACES_INI):
        from .runtime.binding import RACE_DETECTION_ENV

        os.environ[RACE_DETECTION_ENV] = "1"


def kernel_repo_of(path: Path) -> Path | None:
    """The kernel repo (folder with build.toml) a test file belongs to."""
    for parent in Path(path).resolve().parents:
        if (parent / "build.toml").is_file():
            return parent
    return None


@pytest.fixture(scope="session")
def _built_kernels(tmp_path_factory) -> dict[Path, Path]:
    return {}


@pytest.fixture
def kernel(request, _built_kernels, tmp_path_factory):
    """The built torch-cpu variant of the kernel repo this test lives in."""
    from .distribution.builder import KernelSource, build_kernel_repo
    from .distribution.loader import get_local_kernel

    repo = kernel_repo_of(request.path)
    if repo is None:
        raise pytest.UsageError(f"{request.path} is not inside a kernel repo (no build.toml above it)")
    if repo not in _built_kernels:
        prebuilt = os.environ.get(BUILT_ENV)
        if prebuilt and Path(prebuilt).name == KernelSource.open(repo).name:
            _built_kernels[repo] = Path(prebuilt)
        else:
            _built_kernels[repo] = build_kernel_repo(repo, tmp_path_factory.mktemp("build"))
    return get_local_kernel(_built_kernels[repo], backend="cpu")


def interpret(fn, cores: int = 1):
    """`fn()`'s result, its JAX kernels run in Pallas' TPU interpret mode with race detection and NaN-filled
    uninitialised memory, on `cores` TensorCores (v5p's megacore: 2, which split the grid's parallel dimensions).
    `fn` is traced and compiled as one program, with the compile options of the binding's CPU path
    (`runtime.binding.cpu_compile_options`). Fails the test if the interpreter found a data race in any kernel
    it ran."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    from .runtime.binding import RACE_REPORT, cpu_compile_options

    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", num_cores_or_threads=cores)
    printed = io.StringIO()
    with pltpu.force_tpu_interpret_mode(params), redirect_stdout(printed):
        out = jax.block_until_ready(jax.jit(fn, compiler_options=cpu_compile_options())())
    sys.stdout.write(printed.getvalue())
    assert RACE_REPORT not in printed.getvalue(), "the TPU interpreter found a data race"
    return out


@contextmanager
def no_kernel_if(empty: bool):
    """Around a call whose input is `empty`: any Pallas kernel it would run fails the test.

    An empty input must give its result from the static shapes alone: `pallas_call` raises while inside.
    """
    if not empty:
        yield
        return
    import jax.experimental.pallas

    failure = AssertionError("a Pallas kernel ran for an input with an empty dimension")
    with mock.patch.object(jax.experimental.pallas, "pallas_call", side_effect=failure):
        yield


def assert_matches(out, expected, tolerance: float, what: str = "output", floor: float = 0.0) -> None:
    """Same shape (torch tensors); within `tolerance` of the largest reference value, or of `floor` if larger.

    Outputs use no floor: exactly zero where the reference is. Gradients use the inputs' scale, 1: some are
    zero in exact arithmetic (attention's dq with one key, RMSNorm's dx with hidden size 1), where rounding
    leaves ~1e-7.
    """
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(expected.shape)}"
    if expected.numel():
        error = (out.double() - expected.double()).abs().max().item()
        assert error <= tolerance * max(expected.double().abs().max().item(), floor), f"{what}: max error {error}"


def dimensions(**sizes: list[int]):
    """A hypothesis strategy: a size for each named dimension from its (positive) `sizes`; in about half the
    cases one or two of them are 0 instead, so empty inputs come up as often as ones with work in them."""
    from hypothesis import strategies as st

    @st.composite
    def draw_dimensions(draw) -> dict[str, int]:
        drawn = {name: draw(st.sampled_from(values)) for name, values in sizes.items()}
        if draw(st.booleans()):
            for name in draw(st.sets(st.sampled_from(sorted(sizes)), min_size=1, max_size=2)):
                drawn[name] = 0
        return drawn

    return draw_dimensions()


def tiny_transformers_model(model_class, seed: int, **config):
    """A randomly initialised transformers `model_class`, seeded: two decoder layers of hidden size 64, 4 query
    and 2 key/value heads, a vocabulary of 96, unless `config` (fields of `model_class.config_class`) says else.

    Small enough that interpret-mode kernels run its forward and backward passes in seconds.
    """
    import torch

    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return model_class(model_class.config_class(**sizes | config))


def assert_vmem_policy(policy, generation: str) -> None:
    """A kernel's VMEM budget and limit (its module `policy`'s `vmem_budget(target)` and
    `vmem_limit(working_set, target)`, on the generation's facts `resolve_target` gives) are the one policy's
    (`runtime.hardware`) at the kernel's `WORKING_SET_MARGIN` and `WORKING_SET_BOUND_BYTES` (by generation)."""
    from .runtime import hardware

    margin, target = policy.WORKING_SET_MARGIN, hardware.resolve_target(generation)
    assert policy.vmem_budget(target) == hardware.vmem_budget_bytes(
        generation, margin=margin, bound_bytes=policy.WORKING_SET_BOUND_BYTES[generation])
    for working_set in (1 << 20, 20 << 20, 60 << 20):
        assert policy.vmem_limit(working_set, target) == hardware.vmem_limit_bytes(working_set, generation,
                                                                                   margin=margin)


def assert_tuned_table(path: Path, loaded: dict, key_type, tiles_type, selects) -> None:
    """A kernel's tuned tiles table (the JSON file at `path`) has the one form (`runtime.tuning`), reads as `loaded`
    (the kernel's TUNED_TILES), and for each entry's key the kernel `selects` the entry's tiles."""
    import json

    from .runtime import tuning

    table = json.loads(Path(path).read_text())
    assert set(table) == {"what", "entries"}
    for entry in table["entries"]:
        assert set(entry["key"]) == set(key_type._fields) and set(entry["tiles"]) <= set(tiles_type._fields)
    assert tuning.read_tuned_tiles(path, key_type, tiles_type) == loaded
    for key, tiles in loaded.items():
        assert selects(key) == tiles, key


def assert_generation_resolved_once(arrays, *functions) -> None:
    """A kernel's JAX `functions` (each taking `generation=`, traced on `arrays`, shape-dtype structs; not run)
    resolve their generation once, by `runtime.hardware`'s one rule: a name, its facts (made here by tpu_kernels'
    copy of `_hardware`, not the build's) or None (TPU_KERNELS_GENERATION's, else this device's)
    give one program with that generation's tiles, which differ between v5e and v6e at `arrays`; an unknown name
    is refused."""
    import functools
    import re

    import jax

    from .runtime import hardware

    def program(function, generation):
        return str(jax.make_jaxpr(functools.partial(function, generation=generation))(*arrays))

    unknown = re.escape(f"generation must be one of {hardware.SUPPORTED_GENERATIONS}, got 'v2'")
    for function in functions:
        v5e, v6e = program(function, "v5e"), program(function, "v6e")
        assert v5e != v6e, "the programs of v5e and v6e are alike at these arrays: they cannot tell the generations"
        assert program(function, hardware.resolve_target("v5e")) == v5e
        with pytest.MonkeyPatch.context() as patch:
            patch.delenv(hardware.GENERATION_ENV, raising=False)
            this_device = hardware.current_generation()
            assert program(function, None) == (v6e if this_device == "v6e" else program(function, this_device))
            patch.setenv(hardware.GENERATION_ENV, "v5e")
            assert program(function, None) == v5e
        with pytest.raises(ValueError, match=unknown):
            program(function, "v2")
