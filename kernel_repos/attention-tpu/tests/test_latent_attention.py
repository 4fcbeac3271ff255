"""latent_attention (MLA's absorbed form over the latent cache) against the float64 reference, in TPU interpret mode.

Everything runs against the built torch-cpu variant (`kernel` fixture), with race detection and NaN-filled
uninitialised memory on. The torch-level cases take the tiles `latent.tiles.select` picks; the multi-block cases call
the JAX function with small explicit tiles, so that ragged edge blocks, skipped and clamped blocks and head blocks
occur at affordable sizes.
"""

import jax.numpy as jnp
import pytest
import torch
from tpu_kernels import testing
from tpu_kernels.testing import interpret, no_kernel_if

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, seed):
    """(q_latent, q_rope, latent, rope), random normal; the rope ones None where rope_dim is 0."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    q_latent, latent = randn(batch, heads, q_len, latent_dim), randn(batch, 1, kv_len, latent_dim)
    if not rope_dim:
        return q_latent, None, latent, None
    return q_latent, randn(batch, heads, q_len, rope_dim), latent, randn(batch, 1, kv_len, rope_dim)


def _tensors(options):
    return {name: torch.tensor(value, dtype=torch.int32) if isinstance(value, list) else value
            for name, value in options.items()}


def _top_k_mask(batch, q_len, kv_len, keep, seed):
    """bool [B, 1, Sq, S]: `keep` random keys per query, as a DSA indexer's top-k selects them."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, 1, q_len, kv_len, generator=generator)
    chosen = scores.topk(keep, dim=-1).indices
    return torch.zeros(batch, 1, q_len, kv_len, dtype=torch.bool).scatter_(-1, chosen, True)


# batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, options
CASES = {
    # DeepSeek's widths: decode with per-sequence cache lengths (rope keys read keys-minor).
    "decode-16-heads-512-64-bf16": (2, 16, 1, 300, 512, 64, torch.bfloat16, dict(kv_lengths=[300, 77])),
    "decode-5-heads-256-32-offsets": (3, 5, 1, 200, 256, 32, torch.float32,
                                      dict(q_offset=[199, 50, 0], kv_lengths=[200, 120, 1])),
    # No rope keys (GLM-5-Next, Mistral-Large-4's NoPE layers).
    "decode-16-heads-512-0-bf16": (2, 16, 1, 300, 512, 0, torch.bfloat16, dict(kv_lengths=[5, 300])),
    # A speculative step: 3 queries per sequence packed with the heads into one block of rows.
    "speculative-3-of-200-128-32": (2, 5, 3, 200, 128, 32, torch.float32, dict(q_offset=[197, 30],
                                                                               kv_lengths=[200, 33])),
    # DeepSeek-V3's 128 heads, at small lengths.
    "decode-128-heads-512-64-bf16": (1, 128, 1, 64, 512, 64, torch.bfloat16, dict()),
    "prefill-128-heads-20-128-32": (1, 128, 20, 20, 128, 32, torch.float32, dict()),
    # Prefill: one query head; q_rope read queries-minor, its query block past the queries' end.
    "prefill-150-1-head-128-32": (1, 1, 150, 150, 128, 32, torch.float32, dict()),
    "chunk-40-of-300-512-64-bf16": (2, 3, 40, 300, 512, 64, torch.bfloat16, dict(q_offset=[100, 260])),
    "prefill-17-noncausal-512-0": (1, 5, 17, 17, 512, 0, torch.float32, dict(causal=False, scale=0.05)),
}


# The 128 heads of a prefill loop one at a time in interpret mode: seconds.
SLOW_CASES = ("prefill-128-heads-20-128-32",)


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case
                                  for case in CASES])
def test_matches_reference(kernel, case):
    batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, options = CASES[case]
    arrays = _inputs(batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, seed=len(case))
    options = _tensors(options)
    out = kernel.latent_attention(*arrays, **options)
    assert out.shape == (batch, heads, q_len, latent_dim) and out.dtype == dtype
    expected = kernel.reference.reference_latent_attention(*arrays, **options)
    testing.assert_matches(out, expected, TOLERANCE[dtype])


def test_keys_past_the_lengths_may_hold_anything(kernel):
    """The latent and rope past kv_lengths are NaN (a static cache's unused tail may hold anything): none of it may
    reach an output, through the logits or through the values."""
    q_latent, q_rope, latent, rope = _inputs(3, 4, 1, 300, 128, 64, torch.float32, seed=1)
    lengths = torch.tensor([300, 1, 131], dtype=torch.int32)
    for b, length in enumerate(lengths.tolist()):
        latent[b, :, length:] = float("nan")
        rope[b, :, length:] = float("nan")
    out = kernel.latent_attention(q_latent, q_rope, latent, rope, kv_lengths=lengths)
    expected = kernel.reference.reference_latent_attention(q_latent, q_rope, latent, rope, kv_lengths=lengths)
    testing.assert_matches(out, expected, 1e-5)


def test_top_k_mask_and_fully_masked_rows(kernel):
    """A DSA-style sparse mask (16 of 300 keys per query) with padding lengths; batch 1's mask shows no key, so its
    rows are zeros."""
    arrays = _inputs(2, 8, 1, 300, 256, 64, torch.bfloat16, seed=2)
    mask = _top_k_mask(2, 1, 300, 16, seed=3)
    mask[1] = False
    lengths = torch.tensor([300, 300])
    out = kernel.latent_attention(*arrays, attention_mask=mask, kv_lengths=lengths)
    expected = kernel.reference.reference_latent_attention(*arrays, attention_mask=mask, kv_lengths=lengths)
    assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))
    testing.assert_matches(out, expected, 2e-2)


def test_additive_mask_of_a_speculative_step(kernel):
    """A float mask (finfo.min holes, broadcast over the batch) selected per packed row in a step of 2 queries."""
    arrays = _inputs(2, 5, 2, 100, 128, 32, torch.float32, seed=4)
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 1, 2, 100, generator=generator)
    bias = bias.masked_fill(torch.rand(1, 1, 2, 100, generator=generator) < 0.5, torch.finfo(torch.float32).min)
    out = kernel.latent_attention(*arrays, attention_mask=bias)
    expected = kernel.reference.reference_latent_attention(*arrays, attention_mask=bias)
    testing.assert_matches(out, expected, 1e-5)


def test_int8_mask_with_left_padding_in_prefill(kernel):
    """Left padding as an int8 mask over a non-causal prefill: the padded queries see nothing and come out 0."""
    q_len = 40
    arrays = _inputs(2, 3, q_len, q_len, 128, 32, torch.float32, seed=6)
    positions = torch.arange(q_len)
    keep = positions[None, :] >= torch.tensor([0, 13])[:, None]
    mask = ((positions[None, :, None] >= positions[None, None, :]) & keep[:, None, :] & keep[:, :, None])[:, None]
    out = kernel.latent_attention(*arrays, causal=False, attention_mask=mask.to(torch.int8))
    expected = kernel.reference.reference_latent_attention(*arrays, causal=False, attention_mask=mask)
    assert torch.equal(out[1, :, :13], torch.zeros_like(out[1, :, :13]))
    testing.assert_matches(out, expected, 1e-5)


@pytest.mark.parametrize("empty", ["batch", "heads", "q_len", "kv_len"])
def test_empty_inputs_run_no_kernel(kernel, empty):
    sizes = dict(batch=2, heads=3, q_len=2, kv_len=5) | {empty: 0}
    arrays = _inputs(sizes["batch"], sizes["heads"], sizes["q_len"], sizes["kv_len"], 128, 64, torch.float32, seed=7)
    with no_kernel_if(True):
        out = kernel.latent_attention(*arrays)
    assert torch.equal(out, torch.zeros(sizes["batch"], sizes["heads"], sizes["q_len"], 128))


def test_rope_of_width_zero_is_no_rope(kernel):
    q_latent, _, latent, _ = _inputs(1, 2, 1, 50, 128, 0, torch.float32, seed=8)
    no_rope = kernel.latent_attention(q_latent, None, latent, None)
    zero_width = kernel.latent_attention(q_latent, torch.zeros(1, 2, 1, 0), latent, torch.zeros(1, 1, 50, 0))
    assert torch.equal(no_rope, zero_width)


def _bad_input_cases():
    shapes = dict(q_latent=(2, 4, 1, 128), q_rope=(2, 4, 1, 64), latent=(2, 1, 9, 128), rope=(2, 1, 9, 64))

    def replaced(**changes):
        return shapes | changes

    return [
        (replaced(latent=(2, 2, 9, 128)), {}, ValueError, r"latent must have shape \(2, 1, kv_len, 128\)"),
        (replaced(latent=(3, 1, 9, 128)), {}, ValueError, "latent must have shape"),
        (replaced(latent=(2, 1, 9, 256)), {}, ValueError, "latent must have shape"),
        (replaced(q_rope=(2, 4, 1, 32)), {}, ValueError, "rope must have shape"),
        (replaced(q_rope=(2, 3, 1, 64)), {}, ValueError, "q_rope must have shape"),
        (replaced(rope=None), {}, ValueError, "both be given or both be None"),
        (replaced(q_latent=(2, 4, 128)), {}, ValueError, "q_latent must be 4-D"),
        (shapes, dict(dtype=torch.float16), TypeError, "float32 or bfloat16"),
        (shapes, dict(rope_dtype=torch.bfloat16), TypeError, "share one dtype"),
        (shapes, dict(kv_lengths=torch.tensor([3.0, 4.0])), ValueError, "kv_lengths must be"),
        (shapes, dict(q_offset=torch.tensor([1, 2, 3])), ValueError, "q_offset must be"),
        (shapes, dict(q_offset=1.5), TypeError, "q_offset must be an int"),
        (shapes, dict(attention_mask=torch.ones(2, 4, 1, 9, dtype=torch.bool)), ValueError,
         r"attention_mask must have shape \(2 or 1, 1, 1, 9\)"),
        (shapes, dict(attention_mask=torch.ones(2, 1, 1, 9, dtype=torch.int32)), TypeError,
         "attention_mask must be bool or int8"),
        (shapes, dict(scale=float("inf")), ValueError, "scale must be a finite number"),
        (shapes, dict(requires_grad=True), ValueError, "inference-only"),
        (shapes, dict(attention_mask=torch.zeros(2, 1, 1, 9, requires_grad=True)), ValueError, "inference-only"),
    ]


@pytest.mark.parametrize("shapes,change,error,match", _bad_input_cases())
def test_bad_input_raises(kernel, shapes, change, error, match):
    change = dict(change)
    dtype, rope_dtype = change.pop("dtype", torch.float32), change.pop("rope_dtype", None)
    requires_grad = change.pop("requires_grad", False)
    arrays = {name: None if shape is None else torch.randn(shape).to(dtype) for name, shape in shapes.items()}
    if rope_dtype is not None:
        arrays["rope"] = arrays["rope"].to(rope_dtype)
    arrays["q_latent"].requires_grad_(requires_grad)
    with pytest.raises(error, match=match):
        kernel.latent_attention(arrays["q_latent"], arrays["q_rope"], arrays["latent"], arrays["rope"], **change)


def test_grad_is_refused_only_while_enabled(kernel):
    arrays = list(_inputs(1, 2, 1, 9, 128, 64, torch.float32, seed=9))
    arrays[0].requires_grad_(True)
    with torch.no_grad():
        out = kernel.latent_attention(*arrays)
    expected = kernel.reference.reference_latent_attention(*arrays)
    testing.assert_matches(out, expected.detach(), 1e-5)
