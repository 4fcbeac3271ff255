"""ragged_dot through the torch op of the built torch-cpu variant, in TPU interpret mode.

Race detection and NaN-filled uninitialised memory are on (tpu_kernels pytest
plugin), so a kernel that reads garbage or races fails here.
"""

import numpy as np
import pytest
import torch
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

CASES = [
    # m, k, n, group_sizes, transpose_rhs
    (1, 96, 200, [1], False),
    (1, 128, 128, [0, 0, 1, 0], True),
    (7, 96, 200, [3, 0, 2, 1], False),
    (7, 200, 96, [0, 7, 0, 0], True),
    (64, 128, 256, [64], False),
    (64, 200, 96, [10, 0, 0, 30, 4, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 1], True),
    (129, 96, 200, [50, 0, 0, 60], False),
    (129, 256, 200, [129, 0, 0, 0], True),
    (512, 200, 96, [40, 0, 100, 0, 64, 8, 0, 200, 0, 30, 0, 0, 20, 0, 40, 10], False),
    (512, 256, 384, [500, 12, 0, 0], True),
]


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def _random_inputs(m, k, n, group_sizes, transpose_rhs, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lhs = torch.randn(m, k, generator=generator).to(dtype)
    shape = (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
    rhs = torch.randn(shape, generator=generator).to(dtype)
    return lhs, rhs, torch.tensor(group_sizes, dtype=torch.int32)


def _relative_error(out, expected):
    return ((out.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,group_sizes,transpose_rhs", CASES)
def test_matches_reference(kernel, m, k, n, group_sizes, transpose_rhs, dtype):
    lhs, rhs, sizes = _random_inputs(m, k, n, group_sizes, transpose_rhs, dtype)
    out = kernel.ragged_dot(lhs, rhs, sizes, transpose_rhs=transpose_rhs)
    # The reference sees the same (rounded) inputs and computes in float64.
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), sizes, transpose_rhs=transpose_rhs)
    assert out.shape == (m, n) and out.dtype == dtype
    assert not torch.isnan(out).any()
    assert _relative_error(out, expected) <= _tolerance(dtype)
    rows = sum(group_sizes)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:])), "rows past the groups must be zero"


def test_small_tiles_straddle_groups_and_ragged_k(kernel):
    """Tiles smaller than the data: groups straddle row tiles, K and N have ragged edges."""
    lhs, rhs, sizes = _random_inputs(300, 200, 300, [17, 0, 200, 40], True, torch.float32, seed=3)
    config = kernel.config.TileConfig(tile_m=64, tile_k=128, tile_n=128)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")):
        out = kernel.kernel.ragged_dot(lhs.numpy(), rhs.numpy(), sizes.numpy(), transpose_rhs=True, config=config)
    assert not interpret_pallas_call.races.races_found
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), sizes, transpose_rhs=True)
    assert _relative_error(torch.from_numpy(np.array(out)), expected) <= 1e-5


def test_traces_under_torch_compile(kernel):
    lhs, rhs, sizes = _random_inputs(16, 96, 128, [5, 11], False, torch.float32, seed=1)
    compiled = torch.compile(lambda a, b, c: kernel.ragged_dot(a, b, c) * 2, fullgraph=True)
    expected = kernel.reference.ragged_dot_reference(lhs.double(), rhs.double(), sizes) * 2
    assert _relative_error(compiled(lhs, rhs, sizes), expected) <= 1e-5


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(lhs=torch.randn(4, 8, 16)), ValueError, "lhs must be 2-D"),
        (dict(rhs=torch.randn(16, 32)), ValueError, "rhs must be 3-D"),
        (dict(group_sizes=torch.tensor([[4, 4]], dtype=torch.int32)), ValueError, "group_sizes must be 1-D"),
        (dict(lhs=torch.randn(8, 16).to(torch.float64)), TypeError, "lhs must be float32 or bfloat16"),
        (dict(lhs=torch.randn(8, 16).to(torch.int32)), TypeError, "lhs must be float32 or bfloat16"),
        (dict(rhs=torch.randn(2, 16, 32).to(torch.bfloat16)), TypeError, "rhs dtype"),
        (dict(rhs=torch.randn(2, 24, 32)), ValueError, "K mismatch"),
        (dict(group_sizes=torch.tensor([4, 4], dtype=torch.int64)), TypeError, "group_sizes must be int32"),
        (dict(group_sizes=torch.tensor([4, 4, 0], dtype=torch.int32)), ValueError, "3 groups but rhs has 2"),
        (dict(group_sizes=torch.tensor([-1, 4], dtype=torch.int32)), ValueError, "non-negative"),
        (dict(group_sizes=torch.tensor([5, 4], dtype=torch.int32)), ValueError, "sum to 9, past the 8 rows"),
        (dict(lhs=torch.randn(0, 16)), ValueError, "at least one row"),
        (dict(lhs=[[1.0]]), TypeError, "lhs must be a torch.Tensor"),
    ],
)
def test_bad_input_is_refused(kernel, change, error, match):
    args = dict(lhs=torch.randn(8, 16), rhs=torch.randn(2, 16, 32), group_sizes=torch.tensor([4, 4], dtype=torch.int32))
    args.update(change)
    with pytest.raises(error, match=match):
        kernel.ragged_dot(args["lhs"], args["rhs"], args["group_sizes"])
