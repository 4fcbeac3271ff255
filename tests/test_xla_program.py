"""XLA-op traffic from optimized HLO, and kernels joined with their grid replays, against hand counts."""


import dataclasses

import jax
import jax.numpy as jnp
import pytest

from benchmarks import perf
from benchmarks.perf import calibration, hlo, program_time, xla_program
from tpu_kernels.runtime.hardware import tpu_generation

# A hand-written optimized module: a prefetch, a gather fusion, a sliced async prefetch, a relayout copy
# of an argument and a Pallas kernel.
HLO = """HloModule handmade, entry_computation_layout={(bf16[64,256]{1,0:T(8,128)(2,1)})->bf16[16,256]{1,0}}

%fused_gather (param_0: bf16[64,256], param_1: s32[16]) -> bf16[16,256] {
  %param_0 = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[16]{0:T(128)S(1)} parameter(1)
  ROOT %gather.1 = bf16[16,256]{1,0:T(8,128)(2,1)S(1)} gather(%param_0, %param_1), offset_dims={1}, slice_sizes={1,256}
}

%slice_computation (param_0.1: s8[524288]) -> s8[262144] {
  %param_0.1 = s8[524288]{0:T(1024)} parameter(0)
  ROOT %slice.2 = s8[262144]{0:T(1024)S(1)} slice(%param_0.1), slice={[0:262144]}
}

ENTRY %main (table: bf16[64,256], ids: s32[16], weights: bf16[4,256,256], wt: bf16[512,1024]) -> bf16[16,256] {
  %table = bf16[64,256]{1,0:T(8,128)(2,1)} parameter(0)
  %ids = s32[16]{0:T(128)} parameter(1)
  %weights = bf16[4,256,256]{2,1,0:T(8,128)(2,1)} parameter(2)
  %wt = bf16[512,1024]{0,1:T(8,128)(2,1)} parameter(3)
  %copy-start = (s32[16]{0:T(128)S(1)}, s32[16]{0:T(128)}, u32[]{:S(2)}) copy-start(%ids)
  %copy-done = s32[16]{0:T(128)S(1)} copy-done(%copy-start)
  %fusion.1 = bf16[16,256]{1,0:T(8,128)(2,1)S(1)} fusion(%table, %copy-done), kind=kCustom, calls=%fused_gather, backend_config={"estimated_cycles":"1234"}
  %bitcast.1 = s8[524288]{0:T(1024)} bitcast(%weights)
  %slice-start = ((s8[524288]{0:T(1024)}), s8[262144]{0:T(1024)S(1)}, s32[]{:S(2)}) async-start(%bitcast.1), calls=%slice_computation
  %slice-done = s8[262144]{0:T(1024)S(1)} async-done(%slice-start)
  %relayout = bf16[512,1024]{1,0:T(8,128)(2,1)} copy(%wt)
  ROOT %kernel = bf16[16,256]{1,0:T(8,128)(2,1)} custom-call(%fusion.1, %slice-done, %relayout), custom_call_target="tpu_custom_call"
}
"""


@pytest.fixture(scope="module")
def handmade():
    return xla_program.analyse_hlo(HLO, "v6e", codegen_text=HLO)


def test_each_op_moves_the_bytes_its_placement_implies(handmade):
    ops = {op.name: op for op in handmade.ops}
    # Parameters, bitcasts and *-done move nothing; the kernel is listed apart.
    assert set(ops) == {"copy-start", "fusion.1", "slice-start", "relayout"}
    # 16 int32 ids prefetched from HBM into VMEM.
    assert (ops["copy-start"].hbm_read_bytes, ops["copy-start"].vmem_bytes, ops["copy-start"].prefetch) == (64, 64, True)
    # The gather reads 16 of the table's 64 rows (16 x 256 bf16) from HBM, its ids and output live in VMEM.
    assert (ops["fusion.1"].hbm_read_bytes, ops["fusion.1"].hbm_write_bytes) == (16 * 256 * 2, 0)
    assert ops["fusion.1"].vmem_bytes == 64 + 16 * 256 * 2
    assert ops["fusion.1"].estimated_cycles == 1234
    # The sliced prefetch copies half of the 4 x 256 x 256 bf16 weights, not all of them.
    assert ops["slice-start"].hbm_read_bytes == 262144
    assert ops["slice-start"].prefetch and ops["slice-start"].detail == "weights (slice)"
    # The relayout reads and writes the whole 512 x 1024 bf16 argument.
    assert (ops["relayout"].hbm_read_bytes, ops["relayout"].hbm_write_bytes) == (2 * 2**20 // 2, 2**20)
    assert ops["relayout"].detail.startswith("relayout of wt")
    assert handmade.relayout_bytes == 2 * 2**20
    assert handmade.hbm_bytes == 64 + 16 * 256 * 2 + 262144 + 2 * 2**20
    # The two prefetches into VMEM (ids and the weights' slice), which the model charges serially.
    assert handmade.prefetch_bytes == 64 + 262144


def test_relayouts_and_prefetches_are_timed_at_the_devices_bandwidth(handmade):
    """The parts of the XLA ops' time the benchmark names apart, at the bandwidth every XLA op is charged at:
    on v5p both TensorCores' (twice one core's)."""
    program = dataclasses.replace(handmade, generation="v5p", kernels=())
    modelled = program_time.model_program(program, [])
    device = tpu_generation("v5p").device_hbm_bytes_per_s
    assert device == 2 * tpu_generation("v5p").hbm_bytes_per_s
    assert modelled.xla_relayout_s == pytest.approx(2 * 2**20 / device)
    assert modelled.xla_prefetch_s == pytest.approx((64 + 262144) / device)
    assert modelled.xla_relayout_s + modelled.xla_prefetch_s < modelled.xla_s


def test_a_copy_that_changes_the_minor_dimension_is_a_transpose(handmade):
    # %relayout turns wt's {0,1} into {1,0}: a transpose; the prefetch copy keeps its layout.
    assert [op.name for op in handmade.transpose_ops] == ["relayout"]
    assert [op.name for op in handmade.ops if op.opcode.startswith("copy") and not op.transposes] != []


def test_pallas_kernels_are_listed_with_their_operands_placement(handmade):
    [kernel] = handmade.kernels
    assert kernel.operand_spaces == ("vmem", "vmem", "hbm")
    assert kernel.operand_bytes == (16 * 256 * 2, 262144, 2**20)
    assert (kernel.result_spaces, kernel.result_bytes) == (("hbm",), (16 * 256 * 2,))
    placements = handmade.placements(min_bytes=200_000)
    assert any("relayout of wt" in line for line in placements)
    assert any("weights (slice)" in line for line in placements)


# A gather offloaded to the SparseCores, as XLA writes it for v6e (abridged): 8192 of 65536 rows.
OFFLOADED_GATHER_HLO = """HloModule offloaded, entry_computation_layout={(bf16[65536,2048]{1,0:T(8,128)(2,1)}, s32[8192]{0:T(1024)})->bf16[8192,2048]{1,0:T(8,128)(2,1)}}

ENTRY %main (x.1: bf16[65536,2048], i.1: s32[8192]) -> bf16[8192,2048] {
  %x.1 = bf16[65536,2048]{1,0:T(8,128)(2,1)} parameter(0)
  %i.1 = s32[8192]{0:T(1024)} parameter(1)
  %gather_offload_async_start = ((), (), (s32[16384]{0:T(1024)})) async-start(), async_execution_thread="sparsecore", calls=%none
  %gather_offload_async_start.update = ((bf16[65536,2048]{1,0:T(8,128)(2,1)}, s32[8192]{0:T(1024)}), bf16[8192,2048]{1,0:T(8,128)(2,1)}, (s32[16384]{0:T(1024)})) async-update(%gather_offload_async_start, %x.1, %i.1)
  ROOT %gather_offload_async_done = bf16[8192,2048]{1,0:T(8,128)(2,1)} async-done(%gather_offload_async_start.update)
}
"""


def test_an_offloaded_gather_reads_the_rows_it_gathers():
    """Not the whole table (65536 rows), and a table smaller than what is gathered is read once per index."""
    rows = 8192 * 2048 * 2
    program = xla_program.analyse_hlo(OFFLOADED_GATHER_HLO, "v6e")
    [gather] = [op for op in program.ops if op.name == "gather_offload_async_start.update"]
    assert (gather.hbm_read_bytes, gather.hbm_write_bytes) == (rows + 8192 * 4, rows)
    repeated = xla_program.analyse_hlo(OFFLOADED_GATHER_HLO.replace("65536,2048", "1024,2048"), "v6e")
    [gather] = [op for op in repeated.ops if op.name == "gather_offload_async_start.update"]
    assert gather.hbm_read_bytes == rows + 8192 * 4


def _copy_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] + y_ref[...]


def _add(x, y):
    from jax.experimental import pallas as pl

    spec = pl.BlockSpec((128, 256), lambda i: (i, 0))
    return pl.pallas_call(_copy_kernel, grid=(x.shape[0] // 128,), in_specs=[spec, spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


X = jax.ShapeDtypeStruct((512, 256), jnp.float32)


def test_operands_placed_in_vmem_move_no_hbm_bytes_in_the_kernel():
    [call] = perf.model_pallas_traffic(_add, X, X)
    program = xla_program.CompiledProgram(
        generation="v6e", ops=(), notes=(), cost_analysis={}, memory={},
        kernels=(xla_program.KernelCall("add", ("hbm", "vmem"), (2**19, 2**19), ("vmem",), (2**19,)),),
    )
    [placed] = program_time.kernels_as_placed(program, [call])
    x, y, out = (op.hbm_bytes for op in placed.operands)
    assert (x, y, out) == (512 * 256 * 4, 0, 0)
    modelled = program_time.model_program(program, [call])
    assert modelled.hbm_bytes == 512 * 256 * 4
    hbm_bytes_per_s = 1.64e12 * perf.FITTED_RATES.hbm_fraction("v6e")
    assert modelled.time_s == pytest.approx(512 * 256 * 4 / hbm_bytes_per_s + 4 * perf.grid_step_s("v6e"))
    with pytest.raises(ValueError, match="cannot be matched"):
        program_time.kernels_as_placed(program, [call, call])


def test_a_compiled_program_lists_its_kernel_and_xla_ops_and_models_them():
    def layer(x, y):
        return jnp.tanh(_add(x * 2.0, y)).sum(axis=0)

    program = calibration.compile_text(xla_program.lower_program(layer, [X, X], "v6e")).analyse("v6e")
    calls = perf.model_pallas_traffic(layer, X, X)
    assert len(program.kernels) == len(calls) == 1
    assert program.moving_ops  # the scale, tanh and sum run as XLA ops
    assert program.memory["argument_size_in_bytes"] == 2 * 512 * 256 * 4
    modelled = program_time.model_program(program, calls, step_overhead_s=0.0)
    assert modelled.time_s == pytest.approx(modelled.kernels.time_s + modelled.xla_s)
    assert modelled.xla_s > 0
    slower = program_time.model_program(program, calls, step_overhead_s=0.0, hbm_fraction=0.85)
    assert slower.time_s > modelled.time_s


def test_clock_implied_by_the_peak_matches_the_published_v5e_clock():
    assert program_time.clock_hz("v5e") == pytest.approx(1.5e9, rel=0.01)
    assert program_time.clock_hz("v6e") == pytest.approx(1.75e9, rel=0.01)


@pytest.mark.parametrize("shape", ["bf16[2,3]{1,0:T(8,128)(2,1)S(1)}", "(bf16[2,3]{1,0}, (s32[4]{0:S(2)}, f32[]))"])
def test_shapes_parse_into_leaves(shape):
    parsed, end = hlo.parse_shape(shape + " rest", 0)
    leaves = hlo.leaves(parsed)
    assert leaves[0].dims == (2, 3) and leaves[0].bytes == 12
    assert shape.endswith(")") or leaves[0].space == "vmem"
    assert (shape + " rest")[end:].strip() == "rest"




MULTILINE_AND_SPARSECORE_HLO = """HloModule m

%called_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %copy.1 = f32[8]{0} copy(%param_0)
}, execution_thread="sparsecore"

ENTRY %main (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %kernel = f32[1024]{0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config={"metadata":"{
}, more"}
  ROOT %copy = f32[1024]{0} copy(%kernel)
}
"""


def test_a_multiline_attribute_and_a_sparsecore_computation_do_not_end_the_module_early():
    # A kernel's metadata may hold a line starting with "}"; SparseCore computations end with
    # "}, execution_thread=...". Either used to hide the ops after them.
    program = xla_program.analyse_hlo(MULTILINE_AND_SPARSECORE_HLO, "v5e")
    assert [kernel.name for kernel in program.kernels] == ["kernel"]
    assert [op.name for op in program.ops] == ["copy"]
    assert program.ops[0].hbm_bytes == 2 * 1024 * 4
