"""The pytest plugin (tpu_kernels.testing): race detection on only where pytest's configuration asks, and the helpers
kernel repo tests take from it."""

import os
import subprocess
import sys

import pytest

from .conftest import REPO_ROOT

RACE_DETECTION_ENV = "TPU_KERNELS_DETECT_RACES"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("options", "expected"), [((), "None"), (("-o", "tpu_kernels_detect_races=true"), "'1'")])
def test_race_detection_follows_the_pytest_configuration(tmp_path, options, expected):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_env.py").write_text(
        "import os\n\n"
        "def test_env():\n"
        f"    print('detect races:', repr(os.environ.get({RACE_DETECTION_ENV!r})))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != RACE_DETECTION_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    # The plugin's configuration imports torch; torch_tpu's autoload would double that start-up and tests nothing here.
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider", *options, "test_env.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"detect races: {expected}" in result.stdout


def test_interpret_fails_on_a_data_race_and_passes_a_clean_kernel():
    import jax.numpy as jnp

    from tpu_kernels.testing import interpret

    from .test_binding import clean, racy

    x = jnp.ones((8, 128))
    with pytest.raises(AssertionError, match="data race"):
        interpret(lambda: racy(x))
    assert (interpret(lambda: clean(x)) == 2).all()


def _tiled_by_generation(x, *, generation=None):
    """A stand-in kernel whose program depends on its generation's facts, resolved at each call."""
    from tpu_kernels.runtime.hardware import resolve_target

    return x * resolve_target(generation).mxu_size


def test_the_generation_check_passes_a_call_time_resolution_and_fails_a_cached_one():
    import jax

    from tpu_kernels.testing import assert_generation_resolved_once

    x = jax.ShapeDtypeStruct((8, 128), "float32")
    assert_generation_resolved_once((x,), _tiled_by_generation)
    # jit keyed on generation=None keeps the first call's resolution: TPU_KERNELS_GENERATION set later is missed.
    cached = jax.jit(_tiled_by_generation, static_argnames="generation")
    with pytest.raises(AssertionError):
        assert_generation_resolved_once((x,), cached)
