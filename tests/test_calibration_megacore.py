"""tokamax's Pallas ragged dot on a megacore device (v5p) runs on one TensorCore, and the replay prices it so.

tokamax hides the kernel's grid in an `emit_pipeline` inside a grid-less `pallas_call` with no dimension
semantics (`custom_buffered_pallas_call`), so nothing splits the grid over v5p's two TensorCores, although
the inner grid is marked ("parallel", "arbitrary", "arbitrary"). `tokamax_kernels.grid_as_pallas_call`
replays that grid as a plain pallas_call; it must not hand the replay a split the real kernel never makes.
"""

from __future__ import annotations

import pytest

CALL = {"lhs": "bf16[512,256]", "rhs": "bf16[2,256,512]", "group_sizes": [256, 256],
        "ragged_dot_dimension_numbers": {"dot_dimension_numbers": [[[1], [1]], [[], []]],
                                         "lhs_ragged_dimensions": [0], "rhs_group_dimensions": [0]},
        "precision": ["DEFAULT", "DEFAULT"], "preferred_element_type": None, "return_residuals": False,
        "activation": None}
CONFIG = {"tile_m": 128, "tile_k": 256, "tile_n": 128, "input_buffer_count": 2, "combine_scopes": False}


def test_tokamax_ragged_dot_replays_on_one_tensorcore_of_a_v5p():
    pytest.importorskip("tokamax")
    from benchmarks import perf
    from benchmarks.perf import calibration, program_replay, tokamax_calls

    measurement = calibration.Measurement("v5p", "pallas_ragged_dot", "f.json", CALL, CONFIG, (0.1,))
    rebuilt = tokamax_calls.rebuild(measurement)
    with rebuilt.replay_context():
        replayed = program_replay.replay_program(rebuilt.fn, *rebuilt.replay_args)
    [call] = replayed.pallas_calls
    assert call.grid[0] == 4  # four column tiles: a "parallel" first dimension would have split them
    assert set(call.dimension_semantics) == {"arbitrary"} and call.megacore_core is None
    [steps] = call.core_steps(perf.tpu_generation("v5p"))  # every step on one core
    assert len(steps) == call.steps


DLHS = {**CALL, "lhs": "bf16[512,512]", "ragged_dot_dimension_numbers": {
    "dot_dimension_numbers": [[[1], [2]], [[], []]], "lhs_ragged_dimensions": [0], "rhs_group_dimensions": [0]}}


@pytest.mark.parametrize("call, swapped", [
    ({**DLHS, "zero_initialize": True}, True),  # a key from tokamax of 2026-07-14 on: tiles named the other way
    (DLHS, False),  # tokamax 0.0.12's key: tiles as named
    ({**CALL, "zero_initialize": True}, False),  # forward: tiles as named in both
])
def test_an_lhs_gradient_timed_by_a_later_tokamax_is_rebuilt_with_the_tiles_it_ran(call, swapped):
    pytest.importorskip("tokamax")
    from benchmarks.perf import calibration, tokamax_calls

    config = {**CONFIG, "tile_k": 512, "tile_n": 256}
    measurement = calibration.Measurement("v5p", "pallas_ragged_dot", "f.json", call, config, (0.1,))
    tiles = tokamax_calls.timed_tiles(measurement)
    assert (tiles["tile_k"], tiles["tile_n"]) == ((256, 512) if swapped else (512, 256))
    assert tiles["tile_m"] == config["tile_m"] and measurement.config == config  # the entry's own config is kept
