"""Gradients of flash_attention against the float64 reference's autograd, in TPU interpret mode.

The torch-level cases go through the op's autograd (the binding runs the
JAX custom_vjp: the dq and dk/dv Pallas kernels) at the tiles the seams'
`tiles.select` pick; the multi-block cases differentiate the JAX function (custom_vjp) with
small explicit tiles, so ragged edge blocks, skipped blocks, clamped fetches
and blocks walked per KV block all occur. Race detection and NaN-filled
uninitialised memory are on. Tolerance: max |error| / max |expected| per
gradient, 1e-5 in float32 and 2e-2 in bfloat16; inputs are random and sizes
odd (not multiples of any block).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tpu_kernels.testing import interpret

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
MIB = 2**20


def _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, *, sinks, seed):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    tensors = dict(
        q=randn(batch, q_heads, q_len, head_dim),
        k=randn(batch, kv_heads, kv_len, head_dim),
        v=randn(batch, kv_heads, kv_len, head_dim),
        d_out=randn(batch, q_heads, q_len, head_dim),
    )
    if sinks:
        tensors["sinks"] = randn(q_heads)
    return tensors


def _options(options, as_tensor):
    return {name: as_tensor(value) if isinstance(value, list) else value for name, value in options.items()}


def _expected(kernel, tensors, options):
    """Output and float64 gradients of the reference, for q, k, v (and sinks)."""
    names = [n for n in ("q", "k", "v", "sinks") if n in tensors]
    leaves = {n: tensors[n].double().requires_grad_() for n in names}
    out = kernel.reference.reference_attention(
        leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"), **options
    )
    grads = torch.autograd.grad(out, [leaves[n] for n in names], tensors["d_out"].double())
    return out.detach(), dict(zip(names, grads))


def _relative_error(out, expected):
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


def _assert_close(grads, expected, dtype):
    for name, value in grads.items():
        assert not value.isnan().any(), f"NaN in d{name}"
        assert _relative_error(value, expected[name]) <= TOLERANCE[dtype], name


def _mask(batch, q_len, kv_len, *, seed, left_pad):
    """Causal band with random holes and left padding (padded query rows see nothing), bool [B, 1, Sq, Skv]."""
    generator = torch.Generator().manual_seed(seed)
    query_pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    key_pos = torch.arange(kv_len)[None, :]
    keep = key_pos >= torch.tensor(left_pad)[:, None, None]
    mask = (key_pos <= query_pos) & (torch.rand(batch, q_len, kv_len, generator=generator) > 0.2) & keep
    return mask[:, None]


def _bias(q_len, kv_len, *, seed):
    generator = torch.Generator().manual_seed(seed)
    bias = torch.randn(1, 1, q_len, kv_len, generator=generator)
    return bias.masked_fill(torch.rand(1, 1, q_len, kv_len, generator=generator) < 0.3, torch.finfo(torch.float32).min)


# batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, sinks, options
CASES = {
    "mha-17-d64": (2, 2, 2, 17, 17, 64, torch.float32, False, dict()),
    # Default tiles at head_dim 64 over more than 64 positions: one 128-wide block past the arrays' ends, read and
    # written sequence-minor.
    "gqa3-100-sinks-window-softcap": (1, 6, 2, 100, 100, 64, torch.float32, True,
                                      dict(sliding_window=7, softcap=5.0, scale=0.3)),
    "gqa8-40-noncausal-bf16-d128": (1, 8, 1, 40, 40, 128, torch.bfloat16, False, dict(causal=False)),
    # Batch 1 sees no key at all and batch 0's first rows sit before key 0: their gradients are zero, not NaN.
    "gqa4-20-of-50-offsets-lengths": (2, 4, 1, 20, 50, 64, torch.float32, False,
                                      dict(q_offset=[-3, 30], kv_lengths=[45, 0])),
    "bool-mask-left-padding-sinks-bf16": (2, 4, 2, 24, 24, 64, torch.bfloat16, True, dict(causal=False, mask=(0, 9))),
    "bias-mask-19-d256": (1, 2, 1, 19, 19, 256, torch.float32, False, dict(bias=True)),
    "decode-50-sinks-lengths": (2, 8, 2, 1, 50, 64, torch.float32, True, dict(kv_lengths=[50, 13])),
    # Gemma-4's global layers: head_dim 512.
    "gqa4-33-d512-window-softcap-sinks": (1, 4, 1, 33, 33, 512, torch.float32, True,
                                          dict(sliding_window=9, softcap=5.0, scale=1.0)),
    "decode-40-d512-lengths-bf16": (2, 4, 2, 1, 40, 512, torch.bfloat16, False, dict(kv_lengths=[40, 17])),
}


def _resolve_masks(options, batch, q_len, kv_len):
    options = dict(options)
    left_pad = options.pop("mask", None)
    if left_pad is not None:
        options["attention_mask"] = _mask(batch, q_len, kv_len, seed=11, left_pad=list(left_pad))
    if options.pop("bias", False):
        options["attention_mask"] = _bias(q_len, kv_len, seed=12)
    return options


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_op_gradients_match_reference(kernel, case):
    batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, sinks, options = CASES[case]
    tensors = _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, sinks=sinks, seed=len(case))
    options = _resolve_masks(_options(options, lambda x: torch.tensor(x, dtype=torch.int32)), batch, q_len, kv_len)
    names = [n for n in ("q", "k", "v", "sinks") if n in tensors]
    leaves = {n: tensors[n].clone().requires_grad_() for n in names}
    out = kernel.flash_attention(leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"), **options)
    grads = dict(zip(names, torch.autograd.grad(out, [leaves[n] for n in names], tensors["d_out"])))
    expected_out, expected = _expected(kernel, tensors, options)
    assert _relative_error(out.detach(), expected_out) <= TOLERANCE[dtype]
    _assert_close(grads, expected, dtype)
    if case == "gqa4-20-of-50-offsets-lengths":
        assert torch.equal(grads["q"][1], torch.zeros_like(grads["q"][1]))
        assert torch.equal(grads["q"][0, :, :3], torch.zeros_like(grads["q"][0, :, :3]))
        assert torch.equal(grads["k"][0, :, 45:], torch.zeros_like(grads["k"][0, :, 45:]))


# Multi-block cases: the JAX function with explicit tiles.
# batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, sinks, options,
# (forward tiles), (dq tiles), (dk/dv tiles); backward tiles are (block_q, block_kv[, KV heads per step])
BLOCK_CASES = {
    # Causal with a window: 3 ragged query blocks; dk/dv walks at most 3 of them per KV block.
    "causal-300-gqa4-window-sinks": (1, 4, 1, 300, 300, 64, torch.float32, True, dict(sliding_window=100),
                                     (128, 128), (128, 128), (128, 256)),
    # Chunked prefill at offsets with lengths: KV blocks past a length get zero dk/dv; soft-capped; steps of both
    # kernels span both KV heads. At head_dim 64 with blocks of 128s both kernels read and write sequence-minor.
    "chunk-200-of-300-offsets-lengths-softcap": (2, 4, 2, 200, 300, 64, torch.float32, False,
                                                 dict(q_offset=[100, 40], kv_lengths=[300, 170], softcap=3.0),
                                                 (128, 128), (128, 256, 2), (128, 128, 2)),
    # An explicit mask with left padding and holes, across blocks of both axes; bf16, D=128.
    "mask-200-of-300-bf16": (2, 2, 2, 200, 300, 128, torch.bfloat16, False, dict(causal=False, mask=(0, 150)),
                             (128, 128), (128, 128), (128, 128)),
    # Additive mask and a non-causal window (keys after a query stay visible), GQA 2, D=256, sinks;
    # dk/dv steps span both KV heads.
    "bias-window-noncausal-d256-sinks": (1, 4, 2, 150, 260, 256, torch.float32, True,
                                         dict(causal=False, sliding_window=60, bias=True, q_offset=[40]),
                                         (128, 128), (128, 128), (150, 128, 2)),
    # head_dim 512, GQA 4, a causal window over ragged blocks; dq steps span both KV heads.
    "causal-260-gqa4-d512-window": (1, 8, 2, 260, 260, 512, torch.float32, False, dict(sliding_window=150),
                                    (128, 128), (128, 128, 2), (128, 128)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_multi_block_gradients_match_reference(kernel, convert, case):
    to_jax, to_torch = convert
    (batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, sinks, options,
     forward_tiles, dq_tiles, dkv_tiles) = BLOCK_CASES[case]
    tensors = _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, sinks=sinks, seed=len(case))
    torch_options = _resolve_masks(_options(options, lambda x: torch.tensor(x, dtype=torch.int32)), batch, q_len, kv_len)
    jax_options = {n: jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x for n, x in torch_options.items()}
    tiles = dict(
        config=kernel.AttentionConfig(*forward_tiles, 32 * MIB),
        backward_config=kernel.flash_backward.tiles.BackwardConfig(
            dq=kernel.AttentionConfig(*dq_tiles[:2], 32 * MIB, *dq_tiles[2:]),
            dkv=kernel.AttentionConfig(*dkv_tiles[:2], 32 * MIB, *dkv_tiles[2:])),
    )
    names = [n for n in ("q", "k", "v", "sinks") if n in tensors]

    def attention(*arrays):
        named = dict(zip(names, arrays))
        return kernel.flash.kernel.differentiable_flash_attention(named["q"], named["k"], named["v"],
                                                                  sinks=named.get("sinks"), **tiles, **jax_options)

    out, vjp = interpret(lambda: jax.vjp(attention, *[to_jax(tensors[n]) for n in names]))
    grads = interpret(lambda: vjp(to_jax(tensors["d_out"])))
    expected_out, expected = _expected(kernel, tensors, torch_options)
    assert _relative_error(to_torch(out), expected_out) <= TOLERANCE[dtype]
    _assert_close({n: to_torch(g) for n, g in zip(names, grads)}, expected, dtype)


@pytest.mark.slow
def test_keys_past_lengths_may_hold_nan(kernel, convert):
    """Keys and values past kv_lengths are NaN, blocks are ragged: every gradient is finite and those keys get zero."""
    to_jax, to_torch = convert
    tensors = _inputs(2, 4, 2, 140, 300, 64, torch.float32, sinks=False, seed=5)
    lengths = [300, 131]
    for name in ("k", "v"):
        tensors[name][1, :, 131:] = float("nan")
    tiles = kernel.AttentionConfig(128, 128, 32 * MIB)
    backward = kernel.flash_backward.tiles.BackwardConfig(dq=tiles, dkv=tiles)

    def attention(q, k, v):
        return kernel.flash.kernel.differentiable_flash_attention(q, k, v, kv_lengths=jnp.asarray(lengths, jnp.int32),
                                                     config=tiles, backward_config=backward)

    _, vjp = interpret(lambda: jax.vjp(attention, *[to_jax(tensors[n]) for n in ("q", "k", "v")]))
    dq, dk, dv = (to_torch(g) for g in interpret(lambda: vjp(to_jax(tensors["d_out"]))))
    for name in ("k", "v"):
        tensors[name][1, :, 131:] = 0.0
    _, expected = _expected(kernel, tensors, dict(kv_lengths=torch.tensor(lengths)))
    _assert_close(dict(q=dq, k=dk, v=dv), expected, torch.float32)
    assert torch.equal(dk[1, :, 131:], torch.zeros_like(dk[1, :, 131:]))
    assert torch.equal(dv[1, :, 131:], torch.zeros_like(dv[1, :, 131:]))


def test_log_sum_exp_of_the_forward(kernel, convert):
    """The forward's second output: log of each row's softmax denominator (sink included), -inf for empty rows."""
    to_jax, to_torch = convert
    tensors = _inputs(2, 4, 2, 130, 130, 64, torch.float32, sinks=True, seed=6)
    lengths = [130, 0]
    tiles = kernel.AttentionConfig(128, 128, 32 * MIB)
    out, lse = interpret(lambda: kernel.flash.kernel.flash_attention_forward(
        to_jax(tensors["q"]), to_jax(tensors["k"]), to_jax(tensors["v"]), kv_lengths=jnp.asarray(lengths, jnp.int32),
        sinks=to_jax(tensors["sinks"]), config=tiles))
    logits = torch.einsum("bhqd,bhkd->bhqk", tensors["q"].double(),
                          tensors["k"].double().repeat_interleave(2, dim=1)) * 64**-0.5
    visible = kernel.reference.visibility_mask(2, 130, 130, kv_lengths=torch.tensor(lengths))
    logits = logits.masked_fill(~visible, float("-inf"))
    sink = tensors["sinks"].double()[None, :, None, None].expand(2, 4, 130, 1)
    expected = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1)
    np.testing.assert_allclose(np.array(lse), expected.numpy(), rtol=1e-6, atol=1e-6)
    # Without sinks a row that sees nothing has lse = -inf.
    _, lse = interpret(lambda: kernel.flash.kernel.flash_attention_forward(
        to_jax(tensors["q"]), to_jax(tensors["k"]), to_jax(tensors["v"]), kv_lengths=jnp.asarray(lengths, jnp.int32),
        config=tiles))
    assert np.all(np.array(lse)[1] == -np.inf) and np.all(np.isfinite(np.array(lse)[0]))


def test_backward_config_is_checked(kernel):
    q = jnp.zeros((1, 2, 300, 64), jnp.float32)
    good = kernel.AttentionConfig(128, 128, 16 * MIB)
    bad = kernel.AttentionConfig(64, 128, 16 * MIB)
    lse = jnp.zeros((1, 2, 300), jnp.float32)
    with pytest.raises(ValueError, match="config.dkv.block_q must be a multiple of 128"):
        kernel.flash_backward.kernel.flash_attention_backward(
            q, q, q, q, q, lse, config=kernel.flash_backward.tiles.BackwardConfig(dq=good, dkv=bad))
