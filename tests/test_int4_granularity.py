"""The int4 round trip the granularity report uses (benchmarks/studies/int4_granularity.py): per channel it is
what the kernels dequantize; a group is a channel's run of consecutive weights along the contraction."""

import pytest
import torch

from benchmarks.studies.int4_granularity import int4_round_trip
from tpu_kernels.distribution.loader import get_local_kernel
from tpu_kernels.integration.quantize import quantize_int4

from .test_kernelize import ragged_dot_build  # noqa: F401 - fixture


def _weight(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


@pytest.mark.parametrize("out_axis", [1, 2])
def test_per_channel_round_trip_is_what_the_kernels_dequantize(out_axis, ragged_dot_build):
    kernel = get_local_kernel(ragged_dot_build, backend="cpu")
    weight = _weight((3, 128, 192))
    packed, scale_inv = quantize_int4(weight, out_axis, kernel)
    known_axis = 3 - out_axis
    codes = kernel.reference.unpack_int4(packed, weight.shape[known_axis], known_axis)
    dequantized = codes.float() * scale_inv.unsqueeze(3 - out_axis)
    assert torch.equal(int4_round_trip(weight, out_axis, None), dequantized)
    assert torch.equal(int4_round_trip(weight, out_axis, 10_000), dequantized)  # a group past the contraction


@pytest.mark.parametrize("out_axis", [1, 2])
def test_a_group_is_quantized_on_its_own(out_axis):
    weight = _weight((2, 96, 64), seed=1)
    contraction = 3 - out_axis
    grouped = int4_round_trip(weight, out_axis, 32)
    # Scaling one group leaves every other group's round trip as it was, and scales its own.
    scaled = weight.clone()
    index = [slice(None)] * 3
    index[contraction] = slice(32, 64)
    scaled[tuple(index)] *= 5
    rescaled = int4_round_trip(scaled, out_axis, 32)
    others = torch.ones(weight.shape, dtype=torch.bool)
    others[tuple(index)] = False
    assert torch.equal(rescaled[others], grouped[others])
    torch.testing.assert_close(rescaled[tuple(index)], grouped[tuple(index)] * 5, rtol=1e-5, atol=0)
    # Finer scales never err more in total than per-channel ones on these weights.
    assert (grouped - weight).square().sum() < (int4_round_trip(weight, out_axis, None) - weight).square().sum()


def test_a_group_that_does_not_divide_the_contraction_is_refused():
    with pytest.raises(ValueError, match="a group of 48 does not divide the contraction's 64"):
        int4_round_trip(_weight((1, 32, 64)), 1, 48)
