"""latent_attention (MLA's absorbed form over the latent cache) against the float64 reference, in TPU interpret mode,
and its tile selection and plan.

Everything runs against the built torch-cpu variant (`kernel` fixture), with race detection and NaN-filled
uninitialised memory on. The torch-level cases take the tiles `latent.tiles.select` picks; the multi-block cases call
the JAX function with small explicit tiles, so that ragged edge blocks, skipped and clamped blocks and head blocks
occur at affordable sizes. The tile and plan tests run no kernel.
"""

import jax
import jax.numpy as jnp
import pytest
import torch
from tpu_kernels import testing
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS, padded_vmem_bytes, resolve_target
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


def _sinks(heads, dtype, seed=12):
    """[H] random sink logits of `dtype`, about 4 (+- 1): each takes a share of its rows' softmax the tolerances see,
    against a few hundred keys of logits about 0 (+- 1)."""
    return (4 + torch.randn(heads, generator=torch.Generator().manual_seed(seed))).to(dtype)


def _tensors(options, heads):
    """Lists as int32 tensors; `sinks` (a dtype) as random sinks of it, one per head."""
    options = {name: torch.tensor(value, dtype=torch.int32) if isinstance(value, list) else value
               for name, value in options.items()}
    if "sinks" in options:
        options["sinks"] = _sinks(heads, options["sinks"])
    return options


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
    # Sinks (HY-v4's: one logit per head, float32 over bf16 inputs): decode, where batch 1 sees no key; a
    # speculative step (each packed row its head's sink); a chunked prefill (one sink per head of a step).
    "decode-32-heads-sinks-512-64-bf16": (2, 32, 1, 300, 512, 64, torch.bfloat16,
                                          dict(kv_lengths=[300, 0], sinks=torch.float32)),
    "speculative-3-sinks-128-32": (2, 5, 3, 200, 128, 32, torch.float32, dict(q_offset=[197, 30], kv_lengths=[200, 33],
                                                                              sinks=torch.float32)),
    "chunk-40-of-300-sinks-128-32-bf16": (2, 3, 40, 300, 128, 32, torch.bfloat16,
                                          dict(q_offset=[100, 260], sinks=torch.bfloat16)),
}


# The 128 heads of a prefill loop one at a time in interpret mode: seconds.
SLOW_CASES = ("prefill-128-heads-20-128-32",)


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_CASES else case
                                  for case in CASES])
def test_matches_reference(kernel, case):
    batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, options = CASES[case]
    arrays = _inputs(batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, seed=len(case))
    options = _tensors(options, heads)
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


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_top_k_mask_and_fully_masked_rows(kernel, with_sinks):
    """A DSA-style sparse mask (16 of 300 keys per query) with padding lengths; batch 1's mask shows no key, so its
    rows are zeros, with sinks too (the sink attends to nothing)."""
    arrays = _inputs(2, 8, 1, 300, 256, 64, torch.bfloat16, seed=2)
    mask = _top_k_mask(2, 1, 300, 16, seed=3)
    mask[1] = False
    options = dict(attention_mask=mask, kv_lengths=torch.tensor([300, 300]),
                   sinks=_sinks(8, torch.bfloat16) if with_sinks else None)
    out = kernel.latent_attention(*arrays, **options)
    expected = kernel.reference.reference_latent_attention(*arrays, **options)
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


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_int8_mask_with_left_padding_in_prefill(kernel, with_sinks):
    """Left padding as an int8 mask over a non-causal prefill: the padded queries see nothing and come out 0, with
    sinks too."""
    q_len = 40
    arrays = _inputs(2, 3, q_len, q_len, 128, 32, torch.float32, seed=6)
    positions = torch.arange(q_len)
    keep = positions[None, :] >= torch.tensor([0, 13])[:, None]
    mask = ((positions[None, :, None] >= positions[None, None, :]) & keep[:, None, :] & keep[:, :, None])[:, None]
    sinks = _sinks(3, torch.float32) if with_sinks else None
    out = kernel.latent_attention(*arrays, causal=False, attention_mask=mask.to(torch.int8), sinks=sinks)
    expected = kernel.reference.reference_latent_attention(*arrays, causal=False, attention_mask=mask, sinks=sinks)
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
        (shapes, dict(sinks=torch.zeros(2)), ValueError, r"sinks must have shape \(4,\)"),
        (shapes, dict(sinks=torch.zeros(1, 4)), ValueError, r"sinks must have shape \(4,\)"),
        (shapes, dict(sinks=torch.zeros(4, dtype=torch.int32)), TypeError, "sinks must be float32 or bfloat16"),
        (shapes, dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks must be float32 or bfloat16"),
        (shapes, dict(sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor"),
        (shapes, dict(sinks=torch.zeros(4, device="meta")), ValueError, "all tensors must be on one device"),
        (shapes, dict(sinks=torch.zeros(4, requires_grad=True)), ValueError, "inference-only"),
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



@pytest.mark.slow
def test_traces_under_torch_compile(kernel):
    """With and without rope keys, with per-sequence lengths and a mask: one graph, the eager results."""
    arrays = _inputs(2, 4, 1, 40, 128, 32, torch.float32, seed=10)
    lengths, mask = torch.tensor([40, 17], dtype=torch.int32), _top_k_mask(2, 1, 40, 8, seed=11)

    def both_forms(q_latent, q_rope, latent, rope, lengths, mask):
        return (kernel.latent_attention(q_latent, q_rope, latent, rope, kv_lengths=lengths, scale=0.1),
                kernel.latent_attention(q_latent, None, latent, None, attention_mask=mask))

    compiled = torch.compile(both_forms, fullgraph=True)(*arrays, lengths, mask)
    for out, expected in zip(compiled, both_forms(*arrays, lengths, mask)):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


# Multi-block cases through the JAX function with small explicit tiles.


MIB = 1 << 20
TARGETS = [resolve_target(generation) for generation in SUPPORTED_GENERATIONS]

# batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, (block_q, block_kv, heads_per_step), cores, options.
# Where kv_lengths are given, the cache past them is NaN; `sinks` (a dtype): random sinks of it.
BLOCK_CASES = {
    # Decode over 4 KV blocks, the last ragged (rope keys-minor, past the cache's end); batch 1 stops after 2 blocks,
    # batch 2 has no key at all.
    "decode-1000-lengths": (3, 8, 1, 1000, 128, 64, torch.float32, (1, 256, 8), 1, dict(kv_lengths=[1000, 300, 0])),
    # Likewise with sinks: batch 2 still comes out 0.
    "decode-1000-lengths-sinks": (3, 8, 1, 1000, 128, 64, torch.float32, (1, 256, 8), 1,
                                  dict(kv_lengths=[1000, 300, 0], sinks=torch.float32)),
    # The heads in two blocks of 16 rows.
    "decode-400-head-blocks-bf16": (2, 32, 1, 400, 128, 32, torch.bfloat16, (1, 128, 16), 1,
                                    dict(kv_lengths=[400, 129])),
    # A speculative step of 4 queries at per-sequence offsets: heads in blocks of 2 (8 packed rows, each its head's
    # sink), a top-k mask selected per row.
    "speculative-4-mask-head-blocks-sinks": (2, 6, 4, 500, 128, 64, torch.float32, (4, 128, 2), 1,
                                             dict(q_offset=[496, 200], kv_lengths=[500, 204], top_k=40,
                                                  sinks=torch.float32)),
    # Prefill: 3 ragged query blocks x 3 ragged KV blocks, a soft-capped window, heads in blocks of 2 (q_rope read
    # queries-minor, each head its sink), on two cores (megacore splits the head blocks and query blocks): seconds.
    "prefill-300-window-softcap-sinks": (1, 4, 300, 300, 128, 64, torch.float32, (128, 128, 2), 2,
                                         dict(sliding_window=100, softcap=5.0, sinks=torch.float32)),
    # Chunked prefill at per-sequence offsets, non-square blocks, a window, sinks one per head block.
    "chunk-200-of-300-offsets-sinks": (2, 2, 200, 300, 128, 32, torch.float32, (128, 256, 1), 1,
                                       dict(q_offset=[100, 40], sliding_window=64, sinks=torch.bfloat16)),
    # No rope keys, bf16, every head in a prefill step.
    "prefill-300-no-rope-bf16": (1, 3, 300, 300, 256, 0, torch.bfloat16, (128, 128, 3), 1, dict()),
    # A KV block of the whole cache, shorter than a lane tile: the rope keys read row-major.
    "decode-100-rope-row-major": (2, 4, 1, 100, 128, 64, torch.float32, (1, 100, 4), 1, dict(kv_lengths=[100, 37])),
}


def _jax(tensor):
    return None if tensor is None else jnp.asarray(tensor.float().numpy(), jnp.bfloat16 if tensor.dtype ==
                                                  torch.bfloat16 else jnp.float32)


def _run(kernel, arrays, config, cores=1, **options):
    """The JAX function at `config`'s tiles on torch `arrays` with torch `options`, in interpret mode: float32."""
    def to_jax(value):
        if not isinstance(value, torch.Tensor):
            return value
        return _jax(value) if value.dtype.is_floating_point else jnp.asarray(value.numpy())

    jax_options = {name: to_jax(value) for name, value in options.items()}
    out = interpret(lambda: kernel.latent.kernel.latent_attention(*map(_jax, arrays), config=config, **jax_options),
                    cores=cores)
    return torch.from_numpy(jax.device_get(out.astype(jnp.float32)).copy())


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if BLOCK_CASES[case][8] > 1 else case
                                  for case in BLOCK_CASES])
def test_multi_block_matches_reference(kernel, case):
    batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, tiles, cores, options = BLOCK_CASES[case]
    arrays = list(_inputs(batch, heads, q_len, kv_len, latent_dim, rope_dim, dtype, seed=len(case)))
    options = dict(options)
    if "top_k" in options:
        options["attention_mask"] = _top_k_mask(batch, q_len, kv_len, options.pop("top_k"), seed=1)
    options = _tensors(options, heads)
    if "kv_lengths" in options:
        for b, length in enumerate(options["kv_lengths"].tolist()):
            for cache in arrays[2:]:
                if cache is not None:
                    cache[b, :, length:] = float("nan")
    config = kernel.latent.tiles.LatentConfig(*tiles, vmem_limit_bytes=32 * MIB)
    out = _run(kernel, arrays, config, cores, **options)
    expected = kernel.reference.reference_latent_attention(*arrays, **options)
    testing.assert_matches(out, expected, TOLERANCE[dtype])


def test_blocks_outside_the_window_are_skipped(kernel):
    """KV blocks no query can see are neither computed nor fetched: NaN there never shows. Queries 600..607 with a
    window of 64 see keys 537..607, so KV blocks 0-3 (keys 0..511) are NaN; computing one would leak NaN through the
    value product (p = 0 there, but 0 x NaN is NaN)."""
    arrays = _inputs(1, 4, 8, 700, 128, 64, torch.float32, seed=2)
    for cache in arrays[2:]:
        cache[:, :, :512] = float("nan")
    config = kernel.latent.tiles.LatentConfig(8, 128, 4, vmem_limit_bytes=32 * MIB)
    out = _run(kernel, arrays, config, q_offset=600, sliding_window=64)
    q_latent, q_rope, latent, rope = arrays
    expected = kernel.reference.reference_latent_attention(q_latent, q_rope, latent[:, :, 512:], rope[:, :, 512:],
                                                          q_offset=600 - 512, sliding_window=64)
    testing.assert_matches(out, expected, 1e-5)


def test_the_cache_is_read_in_place(kernel):
    """Keys from two arrays and values from the latent, with no concatenation, padding or copy of the cache: the
    kernel takes the latent as it is and the rope as its swapped view (XLA's layout of it)."""
    B, H, S, L, R = 2, 16, 4096, 512, 64
    avals = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((B, H, 1, L), (B, H, 1, R), (B, 1, S, L),
                                                                     (B, 1, S, R))]
    jaxpr = jax.make_jaxpr(lambda *arrays: kernel.latent.kernel.latent_attention(*arrays, generation="v6e"))(*avals)
    primitives = [eqn.primitive.name for eqn in jaxpr.eqns]
    assert "concatenate" not in primitives and "pad" not in primitives
    (call,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    operand_shapes = [var.aval.shape for var in call.invars]
    assert (B, 1, S, L) in operand_shapes and (B, 1, R, S) in operand_shapes


def test_bad_config_raises(kernel):
    tiles = kernel.latent.tiles
    q = jnp.zeros((1, 6, 1, 128), jnp.float32)
    cache = jnp.zeros((1, 1, 300, 128), jnp.float32)
    for config, match in [
        (tiles.LatentConfig(2, 128, 6, 16 * MIB), "block_q must be the query length 1"),
        (tiles.LatentConfig(1, 100, 6, 16 * MIB), "block_kv"),
        (tiles.LatentConfig(1, 128, 4, 16 * MIB), "heads_per_step must divide"),
        (tiles.LatentConfig(1, 128, 3, 16 * MIB), r"must be a multiple of 8"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.latent.kernel.latent_attention(q, None, cache, None, config=config)
    prefill = jnp.zeros((1, 6, 200, 128), jnp.float32)
    with pytest.raises(ValueError, match="block_q must be a multiple of 128"):
        kernel.latent.kernel.latent_attention(prefill, None, cache, None, config=tiles.LatentConfig(100, 128, 1, MIB))


def _problem(kernel, heads, q_len, kv_len, rope_dim=64, mask_dtype=None, has_sinks=False):
    return kernel.common.latent.LatentProblem.of_shape(heads=heads, q_len=q_len, kv_len=kv_len, latent_dim=512,
                                                       rope_dim=rope_dim, dtype=jnp.bfloat16, mask_dtype=mask_dtype,
                                                       has_sinks=has_sinks)


# The decode KV blocks `latent.tiles` documents, by cache length and generation.
DECODE_BLOCKS = {4096: {"v5e": 1024, "v5p": 2048, "v6e": 2048, "tpu7x": 4096},
                 32768: {"v5e": 4096, "v5p": 4096, "v6e": 4096, "tpu7x": 4096}}


@pytest.mark.parametrize("heads", [5, 16, 20, 128])
def test_decode_steps_take_every_head_and_long_blocks(kernel, heads):
    tiles = kernel.latent.tiles
    for target in TARGETS:
        for kv_len, blocks in DECODE_BLOCKS.items():
            problem = _problem(kernel, heads, 1, kv_len)
            config = tiles.select(problem, target)
            assert (config.block_q, config.heads_per_step) == (1, heads)
            working_set = tiles.vmem_bytes(problem, 1, config.block_kv, heads)
            assert working_set <= kernel.vmem_budget(target)
            assert config.vmem_limit_bytes == kernel.vmem_limit(working_set, target)
            if heads == 16:
                assert config.block_kv == blocks[target.name], (target.name, kv_len)


def test_prefill_of_128_heads_takes_blocks_of_them(kernel):
    tiles = kernel.latent.tiles
    for target in TARGETS:
        problem = _problem(kernel, 128, 4096, 4096)
        config = tiles.select(problem, target)
        assert 1 < config.heads_per_step < 128 and 128 % config.heads_per_step == 0
        assert config.block_q % 128 == 0 and config.block_kv % 128 == 0
        assert tiles.vmem_bytes(problem, config.block_q, config.block_kv, config.heads_per_step) <= \
            kernel.vmem_budget(target)


@pytest.mark.parametrize("q_len", [1, 3, 4096])
def test_the_vmem_estimate_counts_the_sinks_block(kernel, q_len):
    """Sinks add the block the kernel reads them in (`kernel._sinks_operands`: a packed step's rows, a prefill step's
    heads), double-buffered, to the working set."""
    latent, target = kernel.latent, resolve_target("v6e")
    plain, with_sinks = (_problem(kernel, 16, q_len, 4096, has_sinks=has_sinks) for has_sinks in (False, True))
    plan = latent.plan.make(with_sinks, target)
    (spec,) = latent.kernel._sinks_operands(jnp.zeros(16, jnp.float32), plan).specs
    tiles = (plan.block_q, plan.block_kv, plan.heads_per_step)
    added = latent.tiles.vmem_bytes(with_sinks, *tiles) - latent.tiles.vmem_bytes(plain, *tiles)
    assert added == 2 * padded_vmem_bytes(spec.block_shape, jnp.float32) > 0
    assert latent.tiles.select(with_sinks, target).vmem_limit_bytes == \
        kernel.vmem_limit(latent.tiles.vmem_bytes(with_sinks, *tiles), target)


def test_plans_read_the_rope_as_xla_stores_it(kernel):
    """Rope keys over more than 64 positions are stored keys-minor at R = 64 and read so; a prefill's q_rope alike."""
    plan, target = kernel.latent.plan, resolve_target("v6e")
    decode = plan.make(_problem(kernel, 16, 1, 4096), target)
    assert decode.packed and decode.rope_keys_minor and not decode.q_rope_queries_minor
    assert (decode.slices, decode.rows, decode.num_q_blocks) == (1, 16, 1)
    speculative = plan.make(_problem(kernel, 5, 3, 4096), target)
    assert speculative.packed and (speculative.slices, speculative.rows) == (1, 15)
    prefill = plan.make(_problem(kernel, 16, 4096, 4096), target)
    assert not prefill.packed and prefill.rope_keys_minor and prefill.q_rope_queries_minor
    assert (prefill.slices, prefill.rows) == (prefill.heads_per_step, prefill.block_q)
    short = plan.make(_problem(kernel, 16, 1, 64), target)
    assert not short.rope_keys_minor and short.block_kv == 64


def test_the_generation_is_resolved_once(kernel):
    avals = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((1, 16, 1, 512), (1, 16, 1, 64),
                                                                     (1, 1, 4096, 512), (1, 1, 4096, 64))]
    testing.assert_generation_resolved_once(avals, kernel.latent.kernel.latent_attention)
