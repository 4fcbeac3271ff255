"""flash_attention against the float64 reference, in TPU interpret mode.

Everything runs against the built torch-cpu variant (`kernel` fixture). Race
detection and NaN-filled uninitialised memory are on, so a kernel that reads
past an array's end into its result, or races, fails here. The torch-level
cases use the tile sizes `flash.tiles.select` picks; the multi-block cases call the
JAX function with small explicit tiles so that ragged edge blocks, skipped
blocks and clamped fetches all occur at affordable sizes.
"""

import dataclasses
import jax.numpy as jnp
import pytest
import torch
from tpu_kernels.testing import interpret

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, kv_len, head_dim, generator=generator).to(dtype)
    v = torch.randn(batch, kv_heads, kv_len, head_dim, generator=generator).to(dtype)
    return q, k, v


def _relative_error(out, expected):
    return ((out.double() - expected).abs().max() / expected.abs().max()).item()


# batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, options
CASES = {
    "prefill-1-gqa8": (1, 8, 1, 1, 1, 128, torch.float32, dict()),
    "prefill-17-mha-d64": (2, 2, 2, 17, 17, 64, torch.float32, dict()),
    "prefill-128-noncausal-gqa8-bf16": (1, 8, 1, 128, 128, 128, torch.bfloat16, dict(causal=False)),
    "prefill-300-gqa8-d64": (1, 8, 1, 300, 300, 64, torch.float32, dict()),
    "prefill-300-mha-bf16-d256": (1, 2, 2, 300, 300, 256, torch.bfloat16, dict()),
    "decode-1-gqa8": (2, 8, 1, 1, 1, 128, torch.float32, dict()),
    "decode-129-mha-noncausal-bf16-d256": (2, 2, 2, 1, 129, 256, torch.bfloat16, dict(causal=False)),
    "decode-1000-gqa8-lengths": (2, 8, 1, 1, 1000, 128, torch.float32, dict(kv_lengths=[1000, 357])),
    "prefill-128-window-softcap": (2, 4, 2, 128, 128, 128, torch.float32, dict(sliding_window=33, softcap=5.0, scale=0.3)),
    "decode-1000-window-bf16": (1, 8, 1, 1, 1000, 64, torch.bfloat16, dict(sliding_window=100)),
    "chunk-17-of-300-offsets": (2, 4, 1, 17, 300, 64, torch.float32, dict(q_offset=[40, 283], kv_lengths=[60, 300])),
    # GPT-OSS-style sinks (its head_dim: q, K and V read sequence-minor, the query block past the queries' end);
    # in decode batch 1 sees no key at all (its rows are zero despite the sink).
    "chunk-100-of-230-gqa3-sinks-window-bf16": (1, 6, 2, 100, 230, 64, torch.bfloat16,
                                                dict(sliding_window=7, sinks=True)),
    "decode-300-sinks-lengths-bf16": (2, 8, 2, 1, 300, 128, torch.bfloat16, dict(kv_lengths=[300, 0], sinks=True)),
    # Gemma-4's global layers (head_dim 512) at the tiles `select` picks there: two ragged query blocks.
    "prefill-300-gqa2-bf16-d512": (1, 2, 1, 300, 300, 512, torch.bfloat16, dict()),
    "prefill-45-gqa4-d512-window-softcap-sinks": (1, 4, 1, 45, 45, 512, torch.float32,
                                                  dict(sliding_window=20, softcap=5.0, scale=1.0, sinks=True)),
    "decode-300-gqa8-d512-lengths-bf16": (2, 8, 1, 1, 300, 512, torch.bfloat16, dict(kv_lengths=[300, 77])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(kernel, case):
    batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, options = CASES[case]
    q, k, v = _qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, seed=len(case))
    options = {
        name: torch.tensor(value, dtype=torch.int32) if isinstance(value, list) else value
        for name, value in options.items()
    }
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(q_heads, generator=torch.Generator().manual_seed(9)).to(dtype)
    out = kernel.flash_attention(q, k, v, **options)
    assert out.shape == q.shape and out.dtype == dtype
    expected = kernel.reference.reference_attention(q, k, v, **options)
    assert _relative_error(out, expected) <= TOLERANCE[dtype]


@pytest.mark.parametrize("q_len", [1, 130])
def test_padded_keys_may_hold_anything(kernel, q_len):
    """Keys and values past kv_lengths are NaN: they must not reach any output (decode, and a prefill whose q, K
    and V are read sequence-minor)."""
    q, k, v = _qkv(3, 4, 2, q_len, 300, 64, torch.float32, seed=1)
    lengths = torch.tensor([300, 1, 131], dtype=torch.int32)
    for b, length in enumerate(lengths.tolist()):
        k[b, :, length:] = float("nan")
        v[b, :, length:] = float("nan")
    out = kernel.flash_attention(q, k, v, kv_lengths=lengths)
    expected = kernel.reference.reference_attention(q, k, v, kv_lengths=lengths)
    assert _relative_error(out, expected) <= 1e-5


def test_rows_without_keys_are_zero(kernel):
    q, k, v = _qkv(2, 4, 1, 6, 40, 128, torch.float32, seed=2)
    # Batch 0 has no keys at all; in batch 1 the first queries sit before key 0.
    out = kernel.flash_attention(q, k, v, q_offset=torch.tensor([10, -3]), kv_lengths=torch.tensor([0, 40]))
    expected = kernel.reference.reference_attention(q, k, v, q_offset=torch.tensor([10, -3]), kv_lengths=torch.tensor([0, 40]))
    assert not out.isnan().any()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
    assert _relative_error(out, expected) <= 1e-5


def test_boolean_mask_with_left_padding(kernel):
    batch, q_len = 2, 40
    q, k, v = _qkv(batch, 8, 2, q_len, q_len, 64, torch.bfloat16, seed=3)
    left_pad = torch.tensor([0, 13])
    positions = torch.arange(q_len)
    keep = positions[None, :] >= left_pad[:, None]  # [B, Skv]
    mask = (positions[None, :, None] >= positions[None, None, :]) & keep[:, None, :]
    mask = mask[:, None]  # [B, 1, Sq, Skv], causal and padded; padded query rows see nothing
    out = kernel.flash_attention(q, k, v, causal=False, attention_mask=mask)
    expected = kernel.reference.reference_attention(q, k, v, causal=False, attention_mask=mask)
    assert torch.equal(out[1, :, :13].float(), torch.zeros_like(out[1, :, :13].float()))
    assert _relative_error(out, expected) <= 2e-2


def test_additive_float_mask(kernel):
    q, k, v = _qkv(2, 2, 1, 17, 17, 64, torch.float32, seed=4)
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 1, 17, 17, generator=generator)
    bias = bias.masked_fill(torch.rand(1, 1, 17, 17, generator=generator) < 0.3, torch.finfo(torch.float32).min)
    out = kernel.flash_attention(q, k, v, attention_mask=bias)
    expected = kernel.reference.reference_attention(q, k, v, attention_mask=bias)
    assert _relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q_heads=6, kv_heads=4), ValueError, "multiple of the number of key/value heads"),
        (dict(head_dim=100), ValueError, "head_dim must be a multiple of 8 from 8 to 576, got 100"),
        (dict(head_dim=1024), ValueError, "head_dim must be a multiple of 8 from 8 to 576, got 1024"),
        (dict(k_dtype=torch.bfloat16), TypeError, "share one dtype"),
        (dict(q_dtype=torch.float16, k_dtype=torch.float16), TypeError, "float32 or bfloat16"),
        (dict(kv_lengths=torch.tensor([3.0, 4.0])), ValueError, "kv_lengths must be"),
        (dict(q_offset=torch.tensor([1, 2, 3])), ValueError, "q_offset must be"),
        (dict(attention_mask=torch.ones(2, 4, 5, 9, dtype=torch.bool)), ValueError, "attention_mask must have shape"),
        (dict(attention_mask=torch.ones(2, 1, 5, 9, dtype=torch.int32)), TypeError, "attention_mask must be bool"),
        (dict(sliding_window=0), ValueError, "sliding_window"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(sinks=torch.zeros(2)), ValueError, r"sinks must be a float32/bfloat16 tensor of shape \(4,\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int32)), ValueError, "sinks must be"),
        (dict(attention_mask=torch.zeros(2, 1, 5, 9, requires_grad=True)), ValueError, "must not require grad"),
    ],
)
def test_bad_input_raises(kernel, change, error, match):
    change = dict(change)
    shape = dict(q_heads=4, kv_heads=2, head_dim=64)
    shape.update({name: change.pop(name) for name in list(change) if name in shape})
    q_dtype, k_dtype = change.pop("q_dtype", torch.float32), change.pop("k_dtype", None)
    q = torch.randn(2, shape["q_heads"], 5, shape["head_dim"]).to(q_dtype)
    k = torch.randn(2, shape["kv_heads"], 9, shape["head_dim"]).to(k_dtype or q_dtype)
    with pytest.raises(error, match=match):
        kernel.flash_attention(q, k, k.clone(), **change)


# Multi-block cases through the JAX function with small explicit tiles.


BLOCK_CASES = {
    # Causal soft-capped prefill with a window: 3 ragged q blocks x 3 ragged kv blocks (head_dim 64: K and V read
    # keys-minor, as XLA stores them).
    "prefill-300-window-softcap": (1, 4, 1, 300, 300, 64, torch.float32, (128, 128, 1),
                                   dict(sliding_window=100, softcap=5.0)),
    # Decode over 4 kv blocks, the last ragged, both KV heads in one step, K and V keys-minor; batch 1 stops after
    # its length.
    "decode-1000-lengths-d64": (2, 8, 2, 1, 1000, 64, torch.bfloat16, (1, 256, 2), dict(kv_lengths=[1000, 300])),
    # A window of 300 keys: the KV grid axis shrinks to 3 steps of the 4 blocks.
    "decode-1000-window": (2, 8, 2, 1, 1000, 128, torch.float32, (1, 256, 1), dict(kv_lengths=[1000, 700], sliding_window=300)),
    # Chunked prefill at per-batch offsets, non-square blocks.
    "chunk-200-of-300": (2, 2, 2, 200, 300, 64, torch.float32, (128, 256, 1), dict(q_offset=[100, 40], sliding_window=64)),
    # head_dim 512: a soft-capped window over ragged blocks of both axes, GQA 2; decode over 3 KV blocks with
    # both KV heads in one step.
    "prefill-300-d512-window-softcap": (1, 4, 2, 300, 300, 512, torch.float32, (128, 128, 1),
                                        dict(sliding_window=100, softcap=5.0)),
    "decode-700-d512-lengths": (2, 4, 2, 1, 700, 512, torch.bfloat16, (1, 256, 2), dict(kv_lengths=[700, 300])),
}


@pytest.mark.parametrize("case", list(BLOCK_CASES))
def test_multi_block_matches_reference(kernel, convert, case):
    _jax, _torch = convert
    batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, (block_q, block_kv, heads), options = BLOCK_CASES[case]
    q, k, v = _qkv(batch, q_heads, kv_heads, q_len, kv_len, head_dim, dtype, seed=len(case))
    torch_options = {n: torch.tensor(x, dtype=torch.int32) if isinstance(x, list) else x for n, x in options.items()}
    jax_options = {n: jnp.asarray(x, jnp.int32) if isinstance(x, list) else x for n, x in options.items()}
    config = kernel.AttentionConfig(block_q, block_kv, 32 * 2**20, kv_heads_per_step=heads)
    out = interpret(lambda: kernel.flash.kernel.differentiable_flash_attention(_jax(q), _jax(k), _jax(v), config=config,
                                                                  **jax_options))
    expected = kernel.reference.reference_attention(q, k, v, **torch_options)
    assert _relative_error(_torch(out), expected) <= TOLERANCE[dtype]


def test_multi_block_mask_with_padding(kernel, convert):
    """An explicit mask over several blocks: left padding, a causal band and random holes.

    Also a non-causal window on top (keys after a query stay visible): the
    window must then not shorten the KV axis.
    """
    _jax, _torch = convert
    batch, q_len, kv_len = 2, 200, 300
    q, k, v = _qkv(batch, 4, 2, q_len, kv_len, 64, torch.float32, seed=6)
    generator = torch.Generator().manual_seed(7)
    query_pos = torch.arange(q_len)[:, None] + (kv_len - q_len)
    key_pos = torch.arange(kv_len)[None, :]
    left_pad = torch.tensor([0, 150])
    mask = (key_pos <= query_pos) & (torch.rand(batch, q_len, kv_len, generator=generator) > 0.2)
    mask = (mask & (key_pos >= left_pad[:, None, None]))[:, None]
    config = kernel.AttentionConfig(block_q=128, block_kv=128, vmem_limit_bytes=32 * 2**20)
    out = interpret(
        lambda: kernel.flash.kernel.differentiable_flash_attention(
            _jax(q), _jax(k), _jax(v), causal=False, attention_mask=jnp.asarray(mask.numpy()), config=config
        )
    )
    expected = kernel.reference.reference_attention(q, k, v, causal=False, attention_mask=mask)
    assert _relative_error(_torch(out), expected) <= 1e-5
    window_options = dict(causal=False, sliding_window=50, q_offset=jnp.asarray([0, 150], jnp.int32))
    out = interpret(
        lambda: kernel.flash.kernel.differentiable_flash_attention(
            _jax(q), _jax(k), _jax(v), attention_mask=jnp.asarray(mask.numpy()), config=config, **window_options
        )
    )
    window_options["q_offset"] = torch.tensor([0, 150])
    expected = kernel.reference.reference_attention(q, k, v, attention_mask=mask, **window_options)
    assert _relative_error(_torch(out), expected) <= 1e-5


def test_blocks_outside_the_window_are_skipped(kernel, convert):
    """K/V blocks no query can see are not computed: NaN there never shows.

    Queries 600..631 with a window of 64 see keys 537..631, so kv blocks 0-3
    (keys 0..511) are NaN. Computing such a block would leak NaN through the PV
    matmul (p = 0 there, but 0 * NaN = NaN).
    """
    _jax, _torch = convert
    q, k, v = _qkv(1, 2, 1, 32, 700, 64, torch.float32, seed=8)
    k[:, :, :512] = float("nan")
    v[:, :, :512] = float("nan")
    config = kernel.AttentionConfig(block_q=32, block_kv=128, vmem_limit_bytes=32 * 2**20)  # block_q = Sq
    out = interpret(
        lambda: kernel.flash.kernel.differentiable_flash_attention(
            _jax(q), _jax(k), _jax(v), q_offset=600, sliding_window=64, config=config
        )
    )
    expected = kernel.reference.reference_attention(q, k[:, :, 512:], v[:, :, 512:], q_offset=600 - 512, sliding_window=64)
    assert _relative_error(_torch(out), expected) <= 1e-5


def test_bad_config_raises(kernel):
    q = jnp.zeros((1, 4, 1, 64), jnp.float32)
    k = jnp.zeros((1, 2, 300, 64), jnp.float32)
    for config, match in [
        (kernel.AttentionConfig(1, 100, 16 * 2**20), "block_kv"),
        (kernel.AttentionConfig(1, 128, 16 * 2**20, kv_heads_per_step=3), "kv_heads_per_step"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.flash.kernel.differentiable_flash_attention(q, k, k, config=config)


def test_grid_lengths_are_exact_with_a_static_offset(kernel):
    """Gemma-4-like window of 1024 at 512-blocks: a query block sees 3 KV blocks (and a KV block 3 query
    blocks); with the offset only known at run time the grid must allow a 4th (misaligned offsets)."""
    q = jnp.zeros((1, 2, 8192, 64), jnp.bfloat16)
    masking = kernel.common.masking
    window = masking.Attention(sliding_window=1024)
    static, _ = masking.prepare(q, q, window)
    dynamic, _ = masking.prepare(q, q, dataclasses.replace(window, q_offset=jnp.zeros((1,), jnp.int32)))
    assert static.static_q_offset == 0 and dynamic.static_q_offset is None
    assert masking.kv_steps(static, 16, 512, 512) == 3 and masking.kv_steps(dynamic, 16, 512, 512) == 4
    assert masking.q_steps(static, 16, 512, 512) == 3 and masking.q_steps(dynamic, 16, 512, 512) == 4
    # Without a window every block of the other axis may be needed.
    plain, _ = masking.prepare(q, q, masking.Attention())
    assert masking.kv_steps(plain, 16, 512, 512) == 16 and masking.q_steps(plain, 16, 512, 512) == 16
