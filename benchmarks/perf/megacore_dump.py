"""Which kernel grids v5p's compiler splits over the device's two TensorCores, read from libtpu's LLO dump.

The dump of each kernel shows the split: a grid the two cores share starts with a megacore barrier and indexes its
blocks by the core id; a grid left to one core runs inside a `PrimaryCoreRegion`. libtpu reads the switch that turns
the dump on (LIBTPU_INIT_ARGS) once, when it starts: the cases compile in a process of their own,
`python -m benchmarks.perf.megacore_dump CASES_MODULE BUILD_FOLDERS_JSON DUMP_DIR`, which prints, as JSON, the dump
files each case's compile added. A cases module is imported by its name from the checkout's root
(`tests.megacore_cases`); its `cases(kernels)` gives {case: (fn, concrete args, its pallas_call's name)} for
{kernel repo name: the loaded kernel}.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

GENERATION = "v5p"
SHARED_MARKER = "BarrierMegacore"
ONE_CORE_MARKER = "PrimaryCoreRegion"
# The checkout, from whose root the process imports the lab and the cases module.
ROOT = Path(__file__).resolve().parents[2]
# The name's end of a dumped program as the LLO pipeline first sees it (its "original" pass).
ORIGINAL_PROGRAM = "-original.txt"


def original_llo_dump_args(dump: Path) -> str:
    """LIBTPU_INIT_ARGS that dump each compiled program's LLO as the pipeline first sees it into `dump`, and no
    other pass: all of them (about 60 per kernel) take longer to write than the compile and fill ~100 MB a kernel."""
    return f"--xla_jf_dump_to={dump} --xla_jf_dump_llo_text=true --xla_jf_dump_llo_pass_label_regex=original"


def load_cases(cases_module: str) -> ModuleType:
    return importlib.import_module(cases_module)


def loaded_kernels(build_folders: dict[str, Path]) -> dict[str, ModuleType]:
    import kernels

    return {name: kernels.get_local_kernel(Path(folder), backend="cpu") for name, folder in build_folders.items()}


def compiled_splits(cases_module: str, build_folders: dict[str, Path], dump: Path) -> dict[str, bool]:
    """{case: whether its kernel's compiled program runs on both cores} for the cases of `cases_module`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS=original_llo_dump_args(dump))
    folders = json.dumps({name: str(folder) for name, folder in build_folders.items()})
    run = subprocess.run([sys.executable, "-m", __name__, cases_module, folders, str(dump)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(f"compiling the megacore cases failed:\n{run.stderr[-3000:]}")
    added = json.loads(run.stdout.strip().splitlines()[-1])
    names = {case: name for case, (_, _, name) in load_cases(cases_module).cases(loaded_kernels(build_folders)).items()}
    splits = {}
    for case, files in added.items():
        # The kernel's program as the LLO pipeline first sees it, named after its pallas_call.
        programs = [f for f in files if f.split("-", 1)[1].startswith(f"{names[case]}.")
                    and f.endswith(ORIGINAL_PROGRAM)]
        if len(programs) != 1:
            raise RuntimeError(f"{case}: not one program named {names[case]} in the dump: {files}")
        text = (dump / programs[0]).read_text()
        shared, one_core = SHARED_MARKER in text, ONE_CORE_MARKER in text
        if shared == one_core:
            raise RuntimeError(f"{case}: the dump shows neither or both ways of running the grid")
        splits[case] = shared
    return splits


def modelled_splits(cases_module: str, build_folders: dict[str, Path]) -> dict[str, bool]:
    """{case: whether the performance model charges its kernel's call for both cores} (`perf.grid_replay`: the first
    "parallel" grid dimension with more than one index)."""
    from benchmarks import perf

    splits = {}
    for case, (fn, args, name) in load_cases(cases_module).cases(loaded_kernels(build_folders)).items():
        (call,) = [call for call in perf.model_pallas_traffic(fn, *args) if call.name == name]
        splits[case] = len(call.core_steps(GENERATION)) == 2
    return splits


def _compile_each(cases_module: str, build_folders: dict[str, Path], dump: Path) -> dict[str, list[str]]:
    import jax

    from tpu_kernels.aot import compile_for

    added = {}
    for case, (fn, args, _) in load_cases(cases_module).cases(loaded_kernels(build_folders)).items():
        before = set(dump.iterdir()) if dump.exists() else set()
        compile_for(fn, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args], GENERATION)
        added[case] = sorted(path.name for path in set(dump.iterdir()) - before)
    return added


if __name__ == "__main__":
    print(json.dumps(_compile_each(sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]))))
