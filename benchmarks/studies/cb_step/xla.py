"""The copies' XLA programs compiled for each generation's compile-only topology and priced by the calibrated model.

As `decode_step` prices its XLA programs: compiled ahead of time through `moe_layer`'s compiler and disk cache,
priced by `perf.program_time.model_program` (every op's HBM / VMEM traffic from the optimized HLO at the fitted
HBM share; no fixed cost per op; XLA ops have no calibrated error: `uncalibrated`).
"""

from __future__ import annotations

from benchmarks import perf
from benchmarks.studies import moe_layer
from benchmarks.studies.decode_step.programs import Program
from benchmarks.studies.moe_layer import modelling


def term(name: str, us: float, per_step: int, **facts) -> dict:
    """One priced part of a path: µs per call, calls per attention layer and step, µs per layer."""
    return {"term": name, "us_per_call": round(us, 3), "calls": per_step, "us": round(us * per_step, 3), **facts}


class XlaPricer:
    """Submits every program for every generation at once (the compiles run on the pool), then prices each."""

    def __init__(self, cache: moe_layer.Cache, compiler: moe_layer.Compiler):
        self.cache, self.compiler = cache, compiler

    def submit(self, program: Program, generation: str):
        return self.compiler.submit(program.fn, list(program.avals), generation, kind="cb_step copies")

    @staticmethod
    def finish(program: Program, future, generation: str) -> dict:
        compiled = future.result()
        if isinstance(compiled, dict):
            return term(program.name, float("nan"), program.per_step, error=compiled.get("error"))
        priced = modelling.price(compiled, perf.ProgramReplay((), ()))
        return term(program.name, priced.pipelined_time_s * 1e6, program.per_step,
                    hbm_bytes_per_call=priced.xla_hbm_bytes, xla_ops=priced.xla_ops,
                    priced_by=f"XLA program compiled for {generation}, priced by perf.program_time")
