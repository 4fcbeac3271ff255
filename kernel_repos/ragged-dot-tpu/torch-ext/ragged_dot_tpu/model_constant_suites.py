"""Microbenchmarks of the costs the performance model fits but no public source states, for the lab's
`python -m benchmarks calibrate --from-benchmark` to fit directly (a least-squares line per term); part of the
suites `kernels benchmark` runs (`benchmark_suites`):

- `GridStep`: an empty Pallas kernel over 1 to 100,000 grid steps (one block kept in VMEM, no copies): the
  fixed cost of a grid step is the slope of time against steps;
- `KernelDma`: a kernel that copies its HBM operand into VMEM once per grid step, each copy waited for before
  the next, 4 KiB to 4 MiB a copy: time per copy against its bytes gives the fixed cost of a copy (intercept)
  and the rate a single copy reaches (slope);
- `HbmStream`: a Pallas copy of 64 MiB to 1 GiB through 1 MiB blocks, BlockSpec-pipelined: the HBM bandwidth
  a streaming kernel reaches (bytes read and written against time);
- `ExpertGather`: XLA's gather of whole expert weights, `weights[picks]`, as transformers' `batched_mm`
  experts do at decode (Qwen3-30B-A3B's gate_up projection on one rank of eight: 16 experts of
  1536 x 2048 bfloat16; 8 to 128 picks): its bandwidth.

The kernels are defined here and registered as torch ops in this build's namespace (`_ops`) when a case first
runs; each case checks its output. Without a TPU, small versions run in interpret mode.
`_benchmark_harness.py` (shipped into every build) says how a case is timed.
"""

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _benchmark_harness as harness
from ._ops import add_op_namespace_prefix, jax_torch_op

LANES = 128
DMA_COPIES = 64
STREAM_COLUMNS = 512
KIB, MIB = 1 << 10, 1 << 20


def _cases(term: str, values, **fixed) -> dict:
    return {f"{term}_{value}": dict(term=term, value=value, **fixed) for value in values}


TPU_CASES = {
    "GridStep": _cases("steps", (1, 10, 100, 1000, 10000, 100000)),
    "KernelDma": _cases("bytes", (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB), copies=DMA_COPIES),
    "HbmStream": _cases("bytes", (64 * MIB, 256 * MIB, 1024 * MIB), block_rows=512),
    "ExpertGather": _cases("picks", (8, 32, 128), experts=16, rows=1536, columns=2048),
}
INTERPRET_CASES = {
    "InterpretModeGridStep": _cases("steps", (4,)),
    "InterpretModeKernelDma": _cases("bytes", (4 * KIB,), copies=2),
    "InterpretModeHbmStream": _cases("bytes", (MIB // 2,), block_rows=128),
    "InterpretModeExpertGather": _cases("picks", (2,), experts=4, rows=64, columns=128),
}


def grid_steps(x: jax.Array, steps: int) -> jax.Array:
    """x back, through `steps` grid steps that keep its one block in VMEM and do nothing."""

    def body(x_ref, out_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            out_ref[...] = x_ref[...]

    block = pl.BlockSpec(x.shape, lambda step: (0, 0))
    return pl.pallas_call(body, grid=(steps,), in_specs=[block], out_specs=block,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def dma_copies(x: jax.Array, copies: int) -> jax.Array:
    """x's first 8 rows, after `copies` copies of the whole of x from HBM into VMEM, each waited for."""

    def body(x_hbm, out_ref, buffer, semaphore):
        copy = pltpu.make_async_copy(x_hbm, buffer, semaphore)
        copy.start()
        copy.wait()

        @pl.when(pl.program_id(0) == copies - 1)
        def _():
            out_ref[...] = buffer[:8, :]

    return pl.pallas_call(
        body, grid=(copies,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((8, LANES), lambda step: (0, 0)), out_shape=jax.ShapeDtypeStruct((8, LANES), x.dtype),
        scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(())])(x)


def stream_copy(x: jax.Array, block_rows: int) -> jax.Array:
    """x copied through VMEM in blocks of `block_rows` rows, the pipeline overlapping reads, writes and steps."""

    def body(x_ref, out_ref):
        out_ref[...] = x_ref[...]

    block = pl.BlockSpec((block_rows, x.shape[1]), lambda step: (step, 0))
    return pl.pallas_call(body, grid=(x.shape[0] // block_rows,), in_specs=[block], out_specs=block,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def gather_experts(weights: jax.Array, picks: jax.Array) -> jax.Array:
    """The picked experts' whole weights, one copy per pick, as XLA gathers them."""
    return jnp.take(weights, picks, axis=0)


_OPS = {}


def op(name: str):
    """The torch op of one kernel above, registered at its first use (loading this file registers nothing)."""
    if name not in _OPS:
        _OPS[name] = jax_torch_op(add_op_namespace_prefix(f"model_constant_{name}"))(globals()[name])
    return _OPS[name]


def model_constant_inputs(case: dict, generator: torch.Generator) -> dict:
    if case["term"] == "steps":
        return dict(x=torch.randn(8, LANES, generator=generator))
    if case["term"] == "bytes" and "copies" in case:
        return dict(x=torch.randn(case["value"] // (4 * LANES), LANES, generator=generator))
    if case["term"] == "bytes":
        return dict(x=torch.randn(case["value"] // (4 * STREAM_COLUMNS), STREAM_COLUMNS, generator=generator))
    weights = torch.randn(case["experts"], case["rows"], case["columns"], generator=generator).to(torch.bfloat16)
    return dict(weights=weights, picks=torch.randint(0, case["experts"], (case["value"],), generator=generator,
                                                     dtype=torch.int32))


class ModelConstantCase(harness.KernelCase):
    def spec(self, case, targets):
        return case

    def make_inputs(self, spec, generator):
        return dict(model_constant_inputs(spec, generator), case=spec)

    def call(self, inputs):
        case = inputs["case"]
        if "weights" in inputs:
            return op("gather_experts")(inputs["weights"], inputs["picks"])
        if case["term"] == "steps":
            return op("grid_steps")(inputs["x"], case["value"])
        if "copies" in case:
            return op("dma_copies")(inputs["x"], case["copies"])
        return op("stream_copy")(inputs["x"], case["block_rows"])

    def expected(self, inputs):
        case = inputs["case"]
        if "weights" in inputs:
            return inputs["weights"][inputs["picks"].long()]
        return inputs["x"][:8] if "copies" in case else inputs["x"]


SUITES = [(ModelConstantCase, TPU_CASES, INTERPRET_CASES)]
