"""The chip rates the performance model prices with: its fitted constants and the clock they run at.

HBM bandwidth, MXU peaks and size, VMEM capacity, the default scoped VMEM
limits and the default per-grid-step cost come from
`tpu_kernels.runtime.hardware` (the module every built kernel carries as
`_hardware.py`), which reads jax's public TPU table
(`jax.experimental.pallas.tpu.get_tpu_info_for_chip`) and names the source
of each number it adds. The constants fitted to real-chip timings (the step
cost per generation, the MXU weight-load share, the vector-unit rates) are
data in model_constants.json, beside this module; the share of the peak HBM
bandwidth each generation's copies reach is data in hbm_fractions.json (fitted
on the timings bound by weight streaming: `python -m benchmarks calibration_fit`;
a file of its own for now, as every key of model_constants.json becomes a row
of the generated constants table in benchmarks/results/pages/calibration.md).

The fitted rates of the MXU, the vector unit and HBM are one frozen value,
`ModelRates`; `FITTED_RATES` holds the fitted ones. Every pricing
function takes such a value as its `rates` parameter (default
`FITTED_RATES`) and hands it down, so pricing with other rates
(`benchmarks.perf.calibration.ModelConstants`) passes them in and changes
nothing shared.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

from tpu_kernels.runtime.hardware import GRID_STEP_OVERHEAD_S, TpuGeneration, tpu_generation

# The model's fitted constants (benchmarks/perf/model_constants.json, written by `python -m benchmarks calibration_fit`):
# data, so that refitting them changes no code and re-prices cached replays without redoing them.
CONSTANTS = json.loads(resources.files(__package__).joinpath("model_constants.json").read_text())


def grid_step_s(generation: str) -> float:
    """The calibrated fixed cost of one Pallas grid step on `generation` (model_constants.json)."""
    steps = CONSTANTS["grid_step_s"]
    return steps.get(generation, GRID_STEP_OVERHEAD_S)


# MXUs per TensorCore used to turn a bf16 peak into a clock: 4 on v4 and v5 ("How to Think About TPUs",
# which also gives v5e's 1.5 GHz clock); assumed 4 on later generations.
MXUS_PER_CORE = 4


def core_clock_hz(generation: str | TpuGeneration) -> float:
    """TensorCore clock implied by the bf16 peak: peak / (MXUs x 2 x mxu_size^2); 1.50 GHz on v5e, 1.75 GHz on v6e."""
    gen = as_generation(generation)
    return gen.bf16_flops_per_s / (MXUS_PER_CORE * 2 * gen.mxu_size**2)


@dataclasses.dataclass(frozen=True)
class ModelRates:
    """The MXU and vector-unit rates the model prices with (module docstring)."""

    # The cycles a weights tile takes to load into the MXU that a pass of fewer rows cannot hide, as a share
    # of `mxu_size` (the scaling book implies all of them, 1.0: a pass would cost max(rows, mxu_size)
    # cycles). Fitted on TPU7x, whose 128-row tiles on the 256-wide MXU cost what 128 rows cost, not 256;
    # v5e's timings (128-row tiles on a 128-wide MXU) cannot tell.
    mxu_weight_load_fraction: float
    # Vector-unit throughput per TensorCore cycle, in (8 x 128) register elements: VPU operations, and
    # operations through the transcendental unit. Fitted on TPU7x (the only chip with vector-bound
    # timings: flash attention); assumed the same per cycle on every generation, at the clock
    # `core_clock_hz` implies.
    vector_elements_per_cycle: float
    transcendental_elements_per_cycle: float
    # The share of the peak HBM bandwidth (jax's table) the copies reach, per generation, as (name, share)
    # pairs: fitted on the timings bound by weight streaming (hbm_fractions.json says on which, and which
    # generations borrow another's). A generation not named streams at the peak.
    hbm_fractions: tuple[tuple[str, float], ...] = ()

    def hbm_fraction(self, generation: str | TpuGeneration) -> float:
        """The share of `generation`'s peak HBM bandwidth its copies reach (1.0 when not given)."""
        name = generation.name if isinstance(generation, TpuGeneration) else generation
        return dict(self.hbm_fractions).get(name, 1.0)

    def vector_elements_per_s(self, generation: str | TpuGeneration) -> float:
        return self.vector_elements_per_cycle * core_clock_hz(generation)

    def transcendental_elements_per_s(self, generation: str | TpuGeneration) -> float:
        return self.transcendental_elements_per_cycle * core_clock_hz(generation)


def read_hbm_fractions() -> tuple[tuple[str, float], ...]:
    """hbm_fractions.json's share of the peak HBM bandwidth per generation (written by the same fit), as pairs."""
    data = json.loads(resources.files(__package__).joinpath("hbm_fractions.json").read_text())
    return tuple(sorted((name, float(share)) for name, share in data["hbm_fraction"].items()))


FITTED_RATES = ModelRates(
    mxu_weight_load_fraction=CONSTANTS["mxu_weight_load_fraction"],
    vector_elements_per_cycle=CONSTANTS["vector_elements_per_cycle"],
    transcendental_elements_per_cycle=CONSTANTS["transcendental_elements_per_cycle"],
    hbm_fractions=read_hbm_fractions(),
)


# What a study's figures were priced at when its JSON does not record it (`priced_at`): the constants before v6e's own
# data priced it (every share 1.0, v6e's grid step v5e's), which the results written before then were priced at.
PRICED_BEFORE_V6E_DATA = {"hbm_fraction": {"v5e": 1.0, "v5p": 1.0, "v6e": 1.0, "tpu7x": 1.0},
                          "grid_step_us": {"v5e": 0.34, "v5p": 0.34, "v6e": 0.34, "tpu7x": 0.72}}


def priced_at_of(study: dict) -> dict:
    """The constants a study's JSON was priced at (`priced_at`, else `PRICED_BEFORE_V6E_DATA`)."""
    return study.get("priced_at", PRICED_BEFORE_V6E_DATA)


def priced_at() -> dict:
    """The constants a study prices with, as its JSON records them (`priced_at`): robustness re-prices the study's
    figures from them, so a study written before a constant moved is re-priced, not misread."""
    return {"hbm_fraction": dict(FITTED_RATES.hbm_fractions),
            "grid_step_us": {name: round(grid_step_s(name) * 1e6, 6) for name in CONSTANTS["grid_step_s"]}}


def as_generation(generation: str | TpuGeneration) -> TpuGeneration:
    return generation if isinstance(generation, TpuGeneration) else tpu_generation(generation)
