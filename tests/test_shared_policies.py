"""The three kernel repos size VMEM by one policy and take tuned tiles from tables of one form.

The policy is `_hardware`'s (`vmem_budget_bytes`, `vmem_limit_bytes`: tpu_kernels/runtime/hardware.py); where a
kernel departs from its defaults, it says so in values (attention's and rmsnorm's WORKING_SET_MARGIN and
WORKING_SET_BOUND_BYTES). The tables are `_tuning`'s (tpu_kernels/runtime/tuning.py): one JSON file per kernel,
beside the code that reads it.
"""

from __future__ import annotations

import json

import pytest

from tpu_kernels.distribution.loader import get_local_kernel
from tpu_kernels.runtime import hardware, tuning

from .test_builder import TUNED_TABLES

MIB = 1 << 20


@pytest.fixture(scope="module")
def configs(kernel_builds):
    """Where attention-tpu and rmsnorm-tpu size VMEM and select tiles, as loaded: each one's face."""
    return {name: get_local_kernel(kernel_builds[name], backend="cpu") for name in ("attention-tpu", "rmsnorm-tpu")}


@pytest.mark.parametrize("generation", hardware.SUPPORTED_GENERATIONS)
def test_every_kernel_sizes_vmem_by_the_one_policy(ragged_dot_kernel, configs, generation):
    for name, config in configs.items():
        policy = config.norm.tiles if name == "rmsnorm-tpu" else config  # rmsnorm-tpu's: its row blocks' tiles
        # It takes the generation's facts, resolved once by its caller.
        target = hardware.resolve_target(generation)
        assert policy.vmem_budget(target) == hardware.vmem_budget_bytes(
            generation, margin=policy.WORKING_SET_MARGIN, bound_bytes=policy.WORKING_SET_BOUND_BYTES[generation])
        for working_set in (MIB, 20 * MIB, 60 * MIB):
            assert policy.vmem_limit(working_set, target) == hardware.vmem_limit_bytes(
                working_set, generation, margin=policy.WORKING_SET_MARGIN)
    # ragged-dot takes the policy's defaults.
    problem = ragged_dot_kernel.MatmulProblem(16384, 2048, 1536, 128, "bfloat16", "bfloat16", False)
    tiles = ragged_dot_kernel.gmm.tiles.TileConfig(512, 2048, 1536, 256)
    assert ragged_dot_kernel.gmm.tiles.vmem_limit(tiles, problem, generation) == hardware.vmem_limit_bytes(
        ragged_dot_kernel.gmm.tiles.vmem_bytes(tiles, problem), generation)
    budget = hardware.vmem_budget_bytes(generation)
    with pytest.raises(ValueError, match=f"past the {budget >> 20} MiB budget on {generation}"):
        # Double-buffered weights blocks of 64 MiB.
        ragged_dot_kernel.gmm.tiles.check_config(ragged_dot_kernel.gmm.tiles.TileConfig(16, 8192, 4096),
                                                 problem._replace(m=64, k=8192, n=4096), generation)


def test_every_kernel_takes_the_tuned_tiles_of_its_table(kernel_builds, ragged_dot_kernel, configs):
    """Each table has the one form, loads as the kernel's TUNED_TILES, and every entry passes its kernel's check
    and is what it selects for the entry's shape."""
    attention, rmsnorm = configs["attention-tpu"], configs["rmsnorm-tpu"]

    def ragged_dot_selects(key):
        problem = ragged_dot_kernel.MatmulProblem(key.m, key.k, key.n, key.groups, key.dtype, key.rhs_dtype,
                                                  key.transpose_rhs)
        return ragged_dot_kernel.gmm.tiles.select(problem, key.generation)

    def attention_selects(key):
        shape = key._asdict()
        generation = shape.pop("generation")
        chosen = attention.flash.tiles.select(attention.Problem.of_shape(**shape), hardware.resolve_target(generation))
        return attention.flash.tiles.ForwardTiles(chosen.block_q, chosen.block_kv, chosen.kv_heads_per_step)

    def rmsnorm_selects(key):
        problem = rmsnorm.NormProblem(key.op, key.rows, key.hidden, key.dtype)
        return rmsnorm.norm.tiles.RowBlockTiles(rmsnorm.norm.tiles.select(problem, hardware.resolve_target(
            key.generation)).block_rows)

    kernels = {  # name: (the loaded table, its key type, its tiles type, what the kernel selects for a key)
        "ragged-dot-tpu": (ragged_dot_kernel.gmm.tiles.TUNED_TILES, ragged_dot_kernel.gmm.tiles.TunedKey,
                           ragged_dot_kernel.gmm.tiles.TileConfig, ragged_dot_selects),
        "attention-tpu": (attention.flash.tiles.TUNED_TILES, attention.flash.tiles.TunedKey,
                          attention.flash.tiles.ForwardTiles, attention_selects),
        "rmsnorm-tpu": (rmsnorm.norm.tiles.TUNED_TILES, rmsnorm.norm.tiles.TunedKey, rmsnorm.norm.tiles.RowBlockTiles,
                        rmsnorm_selects),
    }
    assert set(kernels) == set(TUNED_TABLES) == set(kernel_builds)
    for name, (loaded, key_type, tiles_type, selects) in kernels.items():
        path = kernel_builds[name] / "build" / "torch-cpu" / TUNED_TABLES[name]
        table = json.loads(path.read_text())
        assert set(table) == {"what", "entries"}, name
        for entry in table["entries"]:
            assert set(entry["key"]) == set(key_type._fields) and set(entry["tiles"]) <= set(tiles_type._fields)
        assert tuning.read_tuned_tiles(path, key_type, tiles_type) == loaded
        for key, tiles in loaded.items():
            assert selects(key) == tiles, (name, key)
