"""Settings of every test session in this checkout (tests/ and the kernel repos' tests).

torch.compile's CPU backend (Inductor) compiles C++ for the tests that trace our ops under torch.compile. Two of
its defaults cost the suite CPU time and test nothing of ours, on a CI machine of 2 cores that pytest-xdist
already keeps busy:
- a pool of compile processes per test process (each one imports torch): one compile at a time in the test's
  own process instead;
- probing the host's SIMD instruction sets by compiling and loading a C++ program per candidate, then
  vectorised kernels that take longer to compile: scalar C++ instead. Our ops stay opaque calls either way; the
  graph around them, the fake tensors and the backward Inductor builds are unchanged.
The environment variables reach the subprocesses that tests start (a value already set is kept); the config
covers a torch imported before this hook.

Tests marked `soak` (hours in one process) run only when the `-m` expression names them (`-m soak`). A default
`-m "not soak"` in addopts would not do: a later `-m`, such as the fast tier's, replaces it.
"""

import collections
import os

INDUCTOR_ENVIRONMENT = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_VEC_ISA_OK": "0"}
HEAVY_TIERS = ("slow", "aot", "multiprocess")


def pytest_configure(config):
    for name, value in INDUCTOR_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    from torch._inductor import config as inductor

    inductor.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    inductor.cpp.vec_isa_ok = os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "1"


def pytest_collection_modifyitems(config, items):
    _heaviest_modules_first(items)
    if "soak" in config.getoption("markexpr"):
        return
    soaks = [item for item in items if item.get_closest_marker("soak")]
    if soaks:
        items[:] = [item for item in items if not item.get_closest_marker("soak")]
        config.hook.pytest_deselected(items=soaks)


def _heaviest_modules_first(items):
    """Test modules in order of their tests that start processes (the longest, one by one), then of their tests in
    the other heavy tiers, most first; each module stays whole, in its order.

    pytest-xdist (--dist worksteal) hands each worker a contiguous share and an idle worker steals the tail of the
    other's queue: with the long tests at the front, the run ends on short ones instead of one worker finishing a
    minute-long test alone.
    """
    processes = collections.Counter(item.path for item in items if item.get_closest_marker("multiprocess"))
    heavy = collections.Counter(item.path for item in items
                                if any(item.get_closest_marker(tier) for tier in HEAVY_TIERS))
    items.sort(key=lambda item: (-processes[item.path], -heavy[item.path]))
