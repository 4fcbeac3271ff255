"""Unit tests of the row blocks (norm/tiles.py) of the built variant, through its face: no kernel runs here. The
selectors take a generation's facts, resolved once (`resolve_target`)."""

import functools
import math

import jax
import jax.numpy as jnp
import pytest

from tpu_kernels import testing
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS, resolve_target

MIB = 1 << 20
TARGET = {generation: resolve_target(generation) for generation in SUPPORTED_GENERATIONS}
V5E, V5P, V6E, TPU7X = (TARGET[generation] for generation in ("v5e", "v5p", "v6e", "tpu7x"))
OPS = ["rms_norm", "fused_add_rms_norm", "rms_norm_backward", "fused_add_rms_norm_backward"]


def _problem(kernel, rows: int, hidden: int, dtype, op: str = "rms_norm"):
    return kernel.NormProblem(op, rows, hidden, jnp.dtype(dtype).name)


def test_vmem_bytes_counts_padded_double_buffered_rows_temporaries_and_vectors(kernel):
    # fused_add_rms_norm, bf16: 4 row arrays double-buffered + 2 f32 temporaries per row, hidden padded to 256 lanes;
    # 20 rows pad to 32 (16-row bf16 tiles); weight and partials: 2 x 2 x 8 sublanes of f32.
    per_row = 256 * (2 * 2 * 4 + 4 * 2)
    vectors = 2 * 2 * 8 * 256 * 4
    assert kernel.norm.tiles.vmem_bytes(20, 200, jnp.bfloat16, "fused_add_rms_norm") == 32 * per_row + vectors


@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
@pytest.mark.parametrize("op", OPS)
def test_heuristic_aligns_blocks_fits_the_budget_and_asks_for_its_limit(kernel, generation, op):
    target = TARGET[generation]
    budget = kernel.norm.tiles.vmem_budget(target)
    for rows in (1, 7, 64, 1000, 8192, 100_003):
        for hidden in (96, 200, 2048, 2816, 4096, 5120, 7168):
            for dtype in (jnp.float32, jnp.bfloat16):
                chosen = kernel.norm.tiles.heuristic_config(_problem(kernel, rows, hidden, dtype, op), target)
                align = 8 if dtype == jnp.float32 else 16
                assert chosen.block_rows == rows or chosen.block_rows % align == 0
                assert 1 <= chosen.block_rows <= rows
                working_set = kernel.norm.tiles.vmem_bytes(chosen.block_rows, hidden, dtype, op)
                assert working_set <= budget
                assert chosen.vmem_limit_bytes == kernel.norm.tiles.vmem_limit(working_set, target)
                # Equal blocks: the ragged last block wastes less than one alignment unit per block.
                blocks = math.ceil(rows / chosen.block_rows)
                assert blocks * chosen.block_rows - rows < blocks * align


def test_heuristic_balances_steps_against_traffic(kernel):
    # 64 bf16 rows of 4096: 1 MiB of traffic, 0.6 us on v6e, about 1 step of 0.35 us: one block of all rows.
    assert kernel.norm.tiles.heuristic_config(_problem(kernel, 64, 4096, jnp.bfloat16), V6E).block_rows == 64
    # 8192 rows: sqrt(T / c) steps would be ~16, but v5e's 16 MiB of scoped VMEM (vs 32 MiB) caps blocks lower.
    v5e = kernel.norm.tiles.heuristic_config(_problem(kernel, 8192, 4096, jnp.bfloat16), V5E)
    v6e = kernel.norm.tiles.heuristic_config(_problem(kernel, 8192, 4096, jnp.bfloat16), V6E)
    assert v5e.block_rows < v6e.block_rows


def test_blocks_stay_within_what_the_default_scoped_vmem_holds_with_the_margin(kernel):
    # 16 MiB on v5e and v5p, 32 on v6e; TPU7x's default is not known (_hardware's docstring): v6e's is taken.
    assert [kernel.norm.tiles.vmem_budget(TARGET[g]) for g in ("v5e", "v5p", "v6e", "tpu7x")] == [
        int(16 * MIB * 0.8), int(16 * MIB * 0.8), int(32 * MIB * 0.8), int(32 * MIB * 0.8)]
    # The limit asked for: the working set with the margin, and Mosaic's own scratch (4 MiB, 8 on TPU7x).
    assert kernel.norm.tiles.vmem_limit(12 * MIB, V5E) == 15 * MIB + 4 * MIB
    assert kernel.norm.tiles.vmem_limit(24 * MIB, TPU7X) == 30 * MIB + 8 * MIB


def test_heuristic_raises_the_vmem_limit_for_huge_rows_and_refuses_beyond_capacity(kernel):
    chosen = kernel.norm.tiles.heuristic_config(_problem(kernel, 64, 131_072, jnp.float32, "fused_add_rms_norm"), V5E)
    assert chosen.block_rows == 8 and 16 * MIB < chosen.vmem_limit_bytes <= 96 * MIB
    with pytest.raises(ValueError, match="hidden=262144 is too large for fused_add_rms_norm on v5e"):
        kernel.norm.tiles.heuristic_config(_problem(kernel, 64, 262_144, jnp.float32, "fused_add_rms_norm"), V5E)
    # 64 MiB of VMEM per core: at most 56 MiB asked for on v5p (its working set with the margin and 4 MiB of
    # Mosaic's scratch).
    chosen = kernel.norm.tiles.heuristic_config(_problem(kernel, 64, 65_536, jnp.float32, "fused_add_rms_norm"), V5P)
    assert chosen.block_rows == 8 and 16 * MIB < chosen.vmem_limit_bytes <= 56 * MIB
    with pytest.raises(ValueError, match="hidden=131072 is too large for fused_add_rms_norm on v5p"):
        kernel.norm.tiles.heuristic_config(_problem(kernel, 64, 131_072, jnp.float32, "fused_add_rms_norm"), V5P)


def test_check_block_rows(kernel):
    kernel.norm.tiles.check_block_rows(40, 40, jnp.bfloat16)
    kernel.norm.tiles.check_block_rows(32, 40, jnp.bfloat16)
    kernel.norm.tiles.check_block_rows(8, 40, jnp.float32)
    for block_rows in (8, 0, 20):
        with pytest.raises(ValueError, match="block_rows must be a multiple of 16 for bfloat16 or equal rows=40"):
            kernel.norm.tiles.check_block_rows(block_rows, 40, jnp.bfloat16)


def test_tuned_tiles_override_the_heuristic_and_are_checked(kernel, monkeypatch):
    heuristic = kernel.norm.tiles.heuristic_config(_problem(kernel, 8192, 4096, jnp.bfloat16), V6E)
    assert kernel.norm.tiles.tuned_config(_problem(kernel, 8192, 4096, jnp.bfloat16), V6E) is None
    assert kernel.norm.tiles.select(_problem(kernel, 8192, 4096, jnp.bfloat16), V6E) == heuristic
    key = kernel.norm.tiles.TunedKey("v6e", "rms_norm", 8192, 4096, "bfloat16")
    monkeypatch.setitem(kernel.norm.tiles.TUNED_TILES, key, kernel.norm.tiles.RowBlockTiles(block_rows=1024))
    # The block is the table's; the VMEM limit follows from it.
    working_set = kernel.norm.tiles.vmem_bytes(1024, 4096, jnp.bfloat16, "rms_norm")
    tuned = kernel.norm.tiles.RowBlockConfig(1024, kernel.norm.tiles.vmem_limit(working_set, V6E))
    assert kernel.norm.tiles.select(_problem(kernel, 8192, 4096, jnp.bfloat16), V6E) == tuned
    assert kernel.norm.tiles.select(_problem(kernel, 8192, 4096, jnp.bfloat16, "fused_add_rms_norm"), V6E) != tuned
    monkeypatch.setitem(kernel.norm.tiles.TUNED_TILES, key, kernel.norm.tiles.RowBlockTiles(100))
    with pytest.raises(ValueError, match="block_rows must be a multiple of 16"):
        kernel.norm.tiles.select(_problem(kernel, 8192, 4096, jnp.bfloat16), V6E)


def test_the_jax_functions_resolve_their_generation_once(kernel):
    """Each public JAX function resolves its generation at every call, not once per jit: traced, not run."""
    x, weight = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    norm = kernel.norm.kernel
    testing.assert_generation_resolved_once((x, weight), functools.partial(norm.rms_norm_forward, eps=1e-6))
    testing.assert_generation_resolved_once((x, x, weight), functools.partial(norm.rms_norm_backward, eps=1e-6),
                                            functools.partial(norm.fused_add_rms_norm_forward, eps=1e-6))


def test_bad_arguments_are_refused(kernel):
    with pytest.raises(ValueError, match="op must be one of"):
        kernel.norm.tiles.select(_problem(kernel, 8, 128, jnp.float32, "layer_norm"), V6E)
    with pytest.raises(ValueError, match="rows and hidden must be >= 1"):
        kernel.norm.tiles.heuristic_config(_problem(kernel, 0, 128, jnp.float32), V6E)
