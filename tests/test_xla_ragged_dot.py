"""XLA's own ragged dot: its loop read from the compiled program and replayed with the group sizes' values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from benchmarks import perf
from benchmarks.perf import calibration, program_time, xla_program, xla_ragged_dot

FORWARD = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
M, K, N, G = 4096, 512, 768, 8
AVALS = [jax.ShapeDtypeStruct((M, K), jnp.bfloat16), jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16),
         jax.ShapeDtypeStruct((G,), jnp.int32)]


def forward(lhs, rhs, sizes):
    return lax.ragged_dot_general(lhs, rhs, sizes, FORWARD, preferred_element_type=jnp.float32).astype(lhs.dtype)


@pytest.fixture(scope="module")
def program():
    return calibration.compile_text(xla_program.lower_program(forward, AVALS, "v5e")).analyse("v5e")


def test_the_compiled_loop_is_read_and_the_replay_finds_the_group_sizes(program):
    [looped] = [op for op in program.ops if op.ragged_dot is not None]
    windows = looped.ragged_dot
    assert len(windows.iteration_bounds) == 5 and windows.iteration_bounds[1] == G
    sizes = np.array([512] * G, np.int32)
    replay = perf.replay_program(forward, AVALS[0], AVALS[1], sizes)
    [call] = replay.ragged_dots
    assert (call.lhs_shape, call.rhs_shape, call.group_sizes.tolist()) == ((M, K), (G, K, N), sizes.tolist())
    # XLA's cost analysis counts the dot densely over every group; the model prices the loop instead.
    assert program.cost_analysis["flops"] >= 2 * G * M * K * N
    modelled = program_time.model_program(program, replay.pallas_calls, ragged_dots=replay.ragged_dots)
    loop = xla_ragged_dot.model(call, windows, perf.tpu_generation("v5e"),
                                step_overhead_s=program_time.XLA_RAGGED_DOT_STEP_S["v5e"])
    assert modelled.ragged_dot_s == pytest.approx(loop.seconds) and loop.steps > 0
    assert modelled.pipelined_time_s == pytest.approx(modelled.xla_s + loop.seconds)
    assert modelled.xla_flops < 2 * M * K * N  # the dense count is not charged again


def test_skipped_groups_cost_nothing_and_the_program_needs_the_replayed_dots(program):
    [looped] = [op for op in program.ops if op.ragged_dot is not None]
    v5e = perf.tpu_generation("v5e")
    even = perf.replay_program(forward, AVALS[0], AVALS[1], np.full(G, M // G, np.int32)).ragged_dots[0]
    one_group = perf.replay_program(forward, AVALS[0], AVALS[1], np.array([M] + [0] * (G - 1), np.int32)).ragged_dots[0]
    half = perf.replay_program(forward, AVALS[0], AVALS[1], np.array([M // 2] + [0] * (G - 1), np.int32)).ragged_dots[0]
    cost = {name: xla_ragged_dot.model(call, looped.ragged_dot, v5e, step_overhead_s=0.0)
            for name, call in (("even", even), ("one", one_group), ("half", half))}
    assert cost["half"].seconds == pytest.approx(cost["one"].seconds / 2, rel=0.1)
    assert cost["one"].steps <= cost["even"].steps  # one group: no window shared by two groups
    with pytest.raises(ValueError, match="ragged dot loops but 0 ragged dots were replayed"):
        program_time.model_program(program, [])


def test_a_loop_with_empty_bounds_is_refused_rather_than_guessed():
    call = perf.RaggedDotCall((64, 128), (2, 128, 128), "bfloat16", "bfloat16", "bfloat16", FORWARD,
                              np.array([32, 32]))
    empty = xla_ragged_dot.Windows((), (1, 16, 1), (1, 16, 1))
    with pytest.raises(ValueError, match="loop bounds of this ragged dot .* empty"):
        xla_ragged_dot.model(call, empty, perf.tpu_generation("v5e"), step_overhead_s=0.0)


def test_windows_are_parsed_from_the_backend_config_and_masks_skipped():
    config = ('"window_config":{"is_mask":true,"iteration_bounds":[],"kernel_window_bounds":[],'
              '"output_window_bounds":[]},"window_config":{"is_mask":false,"iteration_bounds":["2","128","443",'
              '"1","1"],"kernel_window_bounds":["1","256","3"],"output_window_bounds":["1","37","3"]}')
    assert xla_ragged_dot.parse_windows(config) == xla_ragged_dot.Windows((2, 128, 443, 1, 1), (1, 256, 3), (1, 37, 3))
    assert xla_ragged_dot.parse_windows('"window_config":{"is_mask":true}') is None


def test_a_weight_gradient_keeps_its_accumulator_on_chip_only_where_the_generation_does():
    """Weight-gradient mode (rows contracted): on v6e each output window is written once per group and never read;
    on v5e and TPU7x it is read and written at every kept iteration (the module docstring's timings)."""
    weight_gradient = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=())
    sizes = np.array([96, 160])  # 3 and 5 chunks of 32 rows
    call = perf.RaggedDotCall((256, 128), (256, 128), "bfloat16", "bfloat16", "float32", weight_gradient, sizes)
    windows = xla_ragged_dot.Windows((1, 2, 1, 1, 8), (1, 4, 1), (1, 16, 1))  # 32-row chunks, a 128 x 128 window
    window = 128 * 128 * xla_ragged_dot.ACCUMULATOR_BYTES
    found = {name: xla_ragged_dot.model(call, windows, perf.tpu_generation(name), step_overhead_s=0.0)
             for name in ("v5e", "v6e", "tpu7x")}
    assert found["v5e"].steps == found["v6e"].steps == 3 + 5  # the chunks each group touches
    # Read and written at each of the 8 kept iterations, against written once per group.
    assert found["v5e"].hbm_bytes - found["v6e"].hbm_bytes == 2 * 8 * window - 2 * window
    assert found["tpu7x"].hbm_bytes == found["v5e"].hbm_bytes
