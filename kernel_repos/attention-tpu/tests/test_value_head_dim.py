"""Latent attention (MLA): q and k of one head dim, v and the output of another, through the flash kernels.

The widths are transformers' MLA models': the expanded form's (192, 128) (DeepSeek-V3, Moonlight) and (96, 64)
(small MiniCPM3-like layers), and the absorbed form's (576, 512), one KV head for every query head (MQA). At these
lengths XLA stores q and k of 192 or 576 sequence-minor and v and the output of 128 or 512 row-major, and every
array of (96, 64) sequence-minor (`common.layout.sequence_minor_by_default`): the kernels read each array as it is
stored, which these cases reach with small explicit tiles (ragged edge blocks, skipped blocks). Against the float64
reference, in TPU interpret mode with race detection; inputs random, never zero.
"""

import jax
import jax.numpy as jnp
import pytest
import torch
from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS, resolve_target
from tpu_kernels.testing import assert_matches, interpret

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
MIB = 2**20
TARGETS = [resolve_target(generation) for generation in SUPPORTED_GENERATIONS]


def _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dims, dtype=torch.float32, *, seed, sinks=False):
    """q [B, Hq, Sq, D], k [B, Hkv, Skv, D], v [B, Hkv, Skv, Dv], d_out [B, Hq, Sq, Dv] (and sinks [Hq])."""
    head_dim, v_head_dim = head_dims
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    tensors = dict(q=randn(batch, q_heads, q_len, head_dim), k=randn(batch, kv_heads, kv_len, head_dim),
                   v=randn(batch, kv_heads, kv_len, v_head_dim), d_out=randn(batch, q_heads, q_len, v_head_dim))
    if sinks:
        tensors["sinks"] = randn(q_heads)
    return tensors


def _reference(kernel, tensors, options):
    """The reference's output and float64 gradients of q, k, v (and sinks)."""
    names = [n for n in ("q", "k", "v", "sinks") if n in tensors]
    leaves = {n: tensors[n].double().requires_grad_() for n in names}
    out = kernel.reference.reference_attention(leaves["q"], leaves["k"], leaves["v"], sinks=leaves.get("sinks"),
                                               **options)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], tensors["d_out"].double())
    return out.detach(), dict(zip(names, grads))


def _left_padded_causal_mask(batch, q_len, kv_len, left_pad, seed):
    generator = torch.Generator().manual_seed(seed)
    query_pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    key_pos = torch.arange(kv_len)[None, :]
    mask = (key_pos <= query_pos) & (torch.rand(batch, q_len, kv_len, generator=generator) > 0.2)
    return (mask & (key_pos >= torch.tensor(left_pad)[:, None, None]))[:, None]


# The torch op at the tiles `tiles.select` picks: batch, q_heads, kv_heads, q_len, kv_len, (D, Dv), dtype, options.
OP_CASES = {
    "expanded-192-128-causal-gqa2": (1, 4, 2, 33, 33, (192, 128), torch.float32, dict()),
    "absorbed-576-512-mqa-decode-lengths-bf16": (2, 16, 1, 1, 70, (576, 512), torch.bfloat16,
                                                 dict(kv_lengths=[70, 23])),
    "expanded-96-64-window-softcap-sinks": (2, 2, 2, 20, 20, (96, 64), torch.float32,
                                            dict(sliding_window=6, softcap=4.0, sinks=True)),
    "absorbed-576-512-mqa-chunk-offsets": (2, 8, 1, 5, 40, (576, 512), torch.float32,
                                           dict(q_offset=[35, 10], kv_lengths=[40, 15], scale=0.05)),
}


@pytest.mark.parametrize("case", list(OP_CASES))
def test_the_op_matches_the_reference(kernel, case):
    batch, q_heads, kv_heads, q_len, kv_len, head_dims, dtype, options = OP_CASES[case]
    options = dict(options)
    tensors = _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dims, dtype, seed=len(case),
                      sinks=options.pop("sinks", False))
    options = {n: torch.tensor(x, dtype=torch.int32) if isinstance(x, list) else x for n, x in options.items()}
    out = kernel.flash_attention(tensors["q"], tensors["k"], tensors["v"], sinks=tensors.get("sinks"), **options)
    assert out.shape == (batch, q_heads, q_len, head_dims[1]) and out.dtype == dtype
    expected, _ = _reference(kernel, tensors, options)
    assert_matches(out, expected, TOLERANCE[dtype])


# The JAX function with explicit tiles: batch, q_heads, kv_heads, q_len, kv_len, (D, Dv), options, forward tiles
# (block_q, block_kv, KV heads per step), and which of q, k, v and the output the forward reads sequence-minor.
BLOCK_CASES = {
    # DeepSeek-V3's expanded prefill: q and k sequence-minor, v and the output row-major; 2 ragged blocks each way.
    "expanded-192-128-causal-window": (1, 2, 2, 200, 200, (192, 128), dict(sliding_window=90), (128, 128, 1),
                                       (True, True, False, False)),
    # Every array sequence-minor; a bool mask with left padding and holes, GQA 2.
    "expanded-96-64-mask": (2, 2, 1, 200, 200, (96, 64), dict(causal=False, mask=(0, 70)), (128, 128, 1),
                            (True, True, True, True)),
    # The absorbed form's decode: the whole group of 16 query heads in one step over one KV head, K keys-minor
    # and V row-major, 3 KV blocks (the last ragged), a batch stopping after its length.
    "absorbed-576-512-mqa-decode": (2, 16, 1, 1, 360, (576, 512), dict(kv_lengths=[360, 200]), (1, 128, 1),
                                    (False, True, False, False)),
    # The other mix: v and the output sequence-minor, q and k row-major; soft-capped, chunked at offsets.
    "values-minor-128-64-offsets-softcap": (2, 2, 1, 130, 200, (128, 64),
                                            dict(q_offset=[70, 10], kv_lengths=[200, 140], softcap=3.0),
                                            (128, 128, 1), (False, False, True, True)),
}


def _resolved(options, batch, q_len, kv_len):
    options = {n: torch.tensor(x, dtype=torch.int32) if isinstance(x, list) else x for n, x in options.items()}
    left_pad = options.pop("mask", None)
    if left_pad is not None:
        options["attention_mask"] = _left_padded_causal_mask(batch, q_len, kv_len, list(left_pad), seed=3)
    return options


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case == "expanded-96-64-mask" else case
                                  for case in BLOCK_CASES])
def test_multi_block_forward_reads_each_array_as_stored(kernel, convert, case):
    to_jax, to_torch = convert
    batch, q_heads, kv_heads, q_len, kv_len, head_dims, options, tiles, minor = BLOCK_CASES[case]
    tensors = _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dims, seed=len(case))
    torch_options = _resolved(options, batch, q_len, kv_len)
    jax_options = {n: jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x for n, x in torch_options.items()}
    config = kernel.AttentionConfig(*tiles[:2], 32 * MIB, kv_heads_per_step=tiles[2])
    arrays = [to_jax(tensors[n]) for n in ("q", "k", "v")]
    problem, _ = kernel.common.masking.prepare(arrays[0], arrays[1], kernel.common.masking.Attention(**jax_options),
                                               v_head_dim=head_dims[1])
    assert tuple(kernel.flash.plan.make(problem, TARGETS[0], config).sequence_minor) == minor
    out = interpret(lambda: kernel.flash.kernel.differentiable_flash_attention(*arrays, config=config,
                                                                               **jax_options))
    expected, _ = _reference(kernel, tensors, torch_options)
    assert_matches(to_torch(out), expected, 1e-5)


# Gradients: batch, q_heads, kv_heads, q_len, kv_len, (D, Dv), sinks, options, forward, dq and dk/dv tiles.
GRADIENT_CASES = {
    "expanded-192-128-causal-sinks": (1, 2, 1, 200, 200, (192, 128), True, dict(), (128, 128), (128, 128),
                                      (128, 128)),
    "expanded-96-64-offsets-lengths-softcap": (2, 4, 2, 200, 200, (96, 64), False,
                                               dict(q_offset=[-3, 0], kv_lengths=[190, 0], softcap=3.0),
                                               (128, 128), (128, 128, 2), (128, 128, 2)),
    "absorbed-576-512-mqa-window-mask": (2, 4, 1, 40, 40, (576, 512), False,
                                         dict(causal=False, mask=(0, 9), sliding_window=20), (40, 40), (40, 40),
                                         (40, 40)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_multi_block_gradients_match_the_reference(kernel, convert, case):
    to_jax, to_torch = convert
    batch, q_heads, kv_heads, q_len, kv_len, head_dims, sinks, options, forward, dq, dkv = GRADIENT_CASES[case]
    tensors = _inputs(batch, q_heads, kv_heads, q_len, kv_len, head_dims, seed=len(case), sinks=sinks)
    torch_options = _resolved(options, batch, q_len, kv_len)
    jax_options = {n: jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x for n, x in torch_options.items()}
    tiles = dict(config=kernel.AttentionConfig(*forward, 32 * MIB),
                 backward_config=kernel.flash_backward.tiles.BackwardConfig(
                     dq=kernel.AttentionConfig(*dq[:2], 32 * MIB, *dq[2:]),
                     dkv=kernel.AttentionConfig(*dkv[:2], 32 * MIB, *dkv[2:])))
    names = [n for n in ("q", "k", "v", "sinks") if n in tensors]

    def attention(*arrays):
        named = dict(zip(names, arrays))
        return kernel.flash.kernel.differentiable_flash_attention(named["q"], named["k"], named["v"],
                                                                  sinks=named.get("sinks"), **tiles, **jax_options)

    out, vjp = interpret(lambda: jax.vjp(attention, *[to_jax(tensors[n]) for n in names]))
    grads = interpret(lambda: vjp(to_jax(tensors["d_out"])))
    expected_out, expected = _reference(kernel, tensors, torch_options)
    assert_matches(to_torch(out), expected_out, 1e-5)
    for name, grad in zip(names, grads):
        assert grad.shape == tensors[name].shape, name
        assert_matches(to_torch(grad), expected[name], 1e-5, f"d{name}", floor=1.0)


@pytest.mark.slow
def test_the_op_differentiates_key_and_value_of_their_own_widths(kernel):
    """Autograd through the torch op: dk [.., 192] and dv [.., 128] at the tiles `select` picks."""
    tensors = _inputs(1, 4, 1, 9, 9, (192, 128), seed=5, sinks=True)
    names = ("q", "k", "v", "sinks")
    leaves = [tensors[n].clone().requires_grad_() for n in names]
    out = kernel.flash_attention(*leaves[:3], sinks=leaves[3])
    grads = torch.autograd.grad(out, leaves, tensors["d_out"])
    expected_out, expected = _reference(kernel, tensors, {})
    assert_matches(out.detach(), expected_out, 1e-5)
    for name, grad in zip(names, grads):
        assert_matches(grad, expected[name], 1e-5, f"d{name}", floor=1.0)


class _Attention(torch.nn.Module):
    is_causal = True


def test_attention_forward_returns_the_value_width(kernel):
    """transformers' entry point, as an MLA layer calls it (value a view of the expanded latent, not contiguous;
    no mask: causal): [B, Sq, Hq, Dv]. Its masks: `test_properties`."""
    tensors = _inputs(2, 4, 4, 7, 7, (192, 128), seed=6)
    value = torch.cat([tensors["v"], tensors["k"][..., :64]], dim=-1)[..., :128]
    assert not value.is_contiguous()
    out, weights = kernel.attention_forward(_Attention(), tensors["q"], tensors["k"], value, None, scaling=0.1)
    expected, _ = _reference(kernel, tensors, dict(scale=0.1, q_offset=0))
    assert weights is None and out.shape == (2, 7, 4, 128)
    assert_matches(out, expected.transpose(1, 2), 1e-5)


def _flash_api_inputs(kernel):
    """flash-attn's [B, S, H, D] q, k and v of 192, 192 and 128, and the reference's [B, Sq, Hq, 128] output."""
    tensors = _inputs(2, 4, 2, 6, 11, (192, 128), seed=8)
    expected, _ = _reference(kernel, tensors, dict(softcap=5.0))
    return [tensors[n].transpose(1, 2) for n in ("q", "k", "v")], expected.transpose(1, 2)


def test_flash_attn_func_takes_a_narrower_value_padded_or_not(kernel):
    """flash-attn 3's call (v [.., 128] -> out [.., 128]) and transformers' flash path's (v zero-padded to the
    query's 192, the output cut back to 128) give the same result."""
    (q, k, v), expected = _flash_api_inputs(kernel)
    out = kernel.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    padded = kernel.flash_attn_func(q, k, torch.nn.functional.pad(v, [0, 64]), causal=True, softcap=5.0)
    assert out.shape == (2, 6, 4, 128)
    assert_matches(out, expected, 1e-5)
    assert_matches(padded[..., :128], expected, 1e-5)
    assert padded[..., 128:].abs().max() == 0


@pytest.mark.slow
def test_flash_attn_varlen_func_takes_a_narrower_value(kernel):
    """Through the ragged kernel (inference) and, with a gradient, the flash kernel."""
    (q, k, v), expected = _flash_api_inputs(kernel)
    cu_q, cu_k = torch.tensor([0, 6, 12], dtype=torch.int32), torch.tensor([0, 11, 22], dtype=torch.int32)
    packed = [x.flatten(0, 1) for x in (q, k, v)]
    varlen = kernel.flash_attn_varlen_func(*packed, cu_q, cu_k, 6, 11, causal=True, softcap=5.0)
    assert_matches(varlen.view(2, 6, 4, 128), expected, 1e-5)
    leaves = [x.clone().requires_grad_() for x in packed]
    trained = kernel.flash_attn_varlen_func(*leaves, cu_q, cu_k, 6, 11, causal=True, softcap=5.0)
    assert_matches(trained.detach().view(2, 6, 4, 128), expected, 1e-5)
    trained.square().sum().backward()
    assert [leaf.grad.shape for leaf in leaves] == [leaf.shape for leaf in leaves]


SAME_BUT_THE_LAST = "must have the same shape but for the head_dim"


# A change of the shapes, the op's error and flash_attn_func's (None: the op's; its layout is [B, S, H, D]).
BAD_SHAPES = [
    (dict(v=(2, 2, 9, 128)), f"key and value {SAME_BUT_THE_LAST}", f"k and v {SAME_BUT_THE_LAST}"),
    (dict(v=(2, 1, 8, 128)), f"key and value {SAME_BUT_THE_LAST}", f"k and v {SAME_BUT_THE_LAST}"),
    (dict(k=(1, 1, 9, 192), v=(1, 1, 9, 128)), "query and key must have the same batch size, got 2 and 1",
     "q and k must have the same batch size, got 2 and 1"),
    (dict(k=(2, 1, 9, 128)), "query and key must have the same head_dim, got 192 and 128", None),
    (dict(v=(2, 1, 9, 100)), "value head_dim must be a multiple of 8 from 8 to 576, got 100", None),
    (dict(v=(2, 1, 9, 640)), "value head_dim must be a multiple of 8 from 8 to 576, got 640", None),
    (dict(q=(2, 4, 5, 584), k=(2, 1, 9, 584)), "head_dim must be a multiple of 8 from 8 to 576, got 584", None),
]


@pytest.mark.parametrize("change, message, flash_api_message", BAD_SHAPES)
def test_key_and_value_differ_in_the_last_dim_only(kernel, change, message, flash_api_message):
    shapes = dict(q=(2, 4, 5, 192), k=(2, 1, 9, 192), v=(2, 1, 9, 128)) | change
    q, k, v = (torch.randn(*shapes[n]) for n in ("q", "k", "v"))
    with pytest.raises(ValueError, match=message):
        kernel.flash_attention(q, k, v)
    with pytest.raises(ValueError, match=flash_api_message or message):
        kernel.flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)))


def test_the_head_dims_served(kernel):
    """Every multiple of 8 up to 576, each of q/k and v on its own: every MLA width of transformers 5.25."""
    for pair in ((192, 128), (96, 64), (256, 256), (128, 128), (576, 512), (160, 128), (288, 256), (320, 256),
                 (512, 512), (192, 192), (576, 576), (8, 8)):
        assert kernel.supports_head_dims(*pair), pair
    for pair in ((100, 64), (192, 130), (584, 512), (0, 64), (64, 0), (True, 64)):
        assert not kernel.supports_head_dims(*pair), pair
    assert kernel.SUPPORTED_HEAD_DIMS == tuple(range(8, 577, 8))
    assert {64, 128, 256, 512} <= set(kernel.SUPPORTED_HEAD_DIMS)
