"""HBM traffic and roofline model of Pallas TPU kernels, for benchmarks without a TPU.

We have no TPU, so the speed of a kernel is argued from what a TPU does with
it. `model_pallas_traffic` traces a JAX function, finds every `pallas_call`
in it and replays each call's grid the way the Mosaic TPU pipeline runs it;
`roofline` prices the replay on a TPU generation. Each module's docstring
states its rules and their sources:

- `program_replay`: the traced function, its pallas_calls and XLA ragged dots, the values their grids need;
- `grid_replay`: one pallas_call's grid, step by step: the blocks each operand copies to and from HBM;
- `kernel_work`: the matmuls and vector-unit work of a kernel body at each grid step;
- `kernel_dmas`: the copies a kernel makes itself of operands left in HBM, at each grid step;
- `traffic`: the replayed call (`PallasCallTraffic`), MXU time per matmul, the pipeline's time;
- `modelled_time`: `roofline`, the modelled time of replayed calls on one generation;
- `chip`: the fitted constants (model_constants.json), the rates priced with (`ModelRates`) and their clock;
- `host_eval`: the replay's small computations on the CPU;
- `xla_program`, `hlo`, `xla_ragged_dot`: what XLA does around the kernels in a compiled program;
- `argument_layouts`: the layout XLA gives each argument and the copies into other layouts it makes per call;
- `program_time`: the modelled time of a compiled program, its kernels replayed and its XLA ops by traffic;
- `calibration`, `tokamax_calls`, `tokamax_kernels`: the model against tokamax's
  measured TPU timings (`python -m benchmarks calibrate`).

The MXU and vector rates and each generation's share of the peak HBM
bandwidth are a value every pricing function takes as `rates`, by default the
fitted `FITTED_RATES`; to price with others, pass a `ModelRates` of them.
"""

from __future__ import annotations

from tpu_kernels.runtime.hardware import tpu_generation
from .chip import CONSTANTS, FITTED_RATES, ModelRates, core_clock_hz, grid_step_s
from .grid_replay import ActiveStepsFn
from .modelled_time import ModelledTime, roofline, with_operands_on_chip
from .program_replay import REPLAY_MODULES, ProgramReplay, RaggedDotCall, model_pallas_traffic, replay_program
from .traffic import DotShape, OperandTraffic, PallasCallTraffic, pipeline_seconds

__all__ = [
    "CONSTANTS", "FITTED_RATES", "REPLAY_MODULES", "ActiveStepsFn", "DotShape", "ModelRates", "ModelledTime",
    "OperandTraffic", "PallasCallTraffic", "ProgramReplay", "RaggedDotCall", "core_clock_hz", "grid_step_s",
    "model_pallas_traffic", "pipeline_seconds", "replay_program", "roofline", "tpu_generation",
    "with_operands_on_chip",
]
