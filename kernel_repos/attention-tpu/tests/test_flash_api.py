"""flash_attn_func and flash_attn_varlen_func against flash-attn 2's semantics, written out in float64 (conftest).

The oracle (conftest's `flash_reference`) states flash-attn's masking directly (query i of a sequence
sits at key position i + Sk - Sq; window (left, right) keeps keys in
[pos - left, pos + right]; causal is right = 0), independent of how
`flash_api` maps it onto the kernel's options. Runs the built torch-cpu
variant in TPU interpret mode.
"""

import inspect

import pytest
import torch
from tpu_kernels.testing import assert_matches

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _tensors(shapes, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=generator).to(dtype) for shape in shapes]


# batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype, options
DENSE_CASES = {
    "causal-square-gqa4": (2, 19, 19, 4, 1, 64, torch.float32, dict(causal=True)),
    "causal-bottom-right-chunk": (1, 5, 37, 4, 2, 128, torch.float32, dict(causal=True)),
    "causal-more-queries-than-keys": (2, 9, 4, 2, 2, 64, torch.float32, dict(causal=True)),
    "noncausal-bf16": (1, 7, 30, 8, 2, 128, torch.bfloat16, dict()),
    # transformers' sliding window: (w - 1, w - 1) with causal.
    "window-causal-softcap-scale": (1, 40, 40, 4, 2, 64, torch.float32,
                                    dict(causal=True, window_size=(5, 5), softcap=4.0, softmax_scale=0.2)),
    "window-left-only-noncausal": (1, 12, 20, 2, 1, 64, torch.float32, dict(window_size=(3, -1))),
    "noncausal-right-0-is-causal": (1, 6, 6, 2, 2, 64, torch.float32, dict(window_size=(-1, 0))),
    "right-past-keys-is-unbounded": (1, 6, 6, 2, 2, 64, torch.float32, dict(window_size=(2, 6))),
    "sinks-window-decode": (3, 1, 25, 4, 2, 64, torch.float32, dict(causal=True, window_size=(7, 7), sinks=True)),
    "sinks-prefill-bf16": (1, 11, 11, 4, 4, 256, torch.bfloat16, dict(causal=True, sinks=True)),
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_flash_attn_func_matches_flash_semantics(kernel, flash_reference, case):
    batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype, options = DENSE_CASES[case]
    q, k, v = _tensors([(batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim),
                        (batch, kv_len, kv_heads, head_dim)], dtype, seed=len(case))
    sinks = torch.randn(q_heads, generator=torch.Generator().manual_seed(3)).to(dtype) if options.pop("sinks", 0) else None
    out = kernel.flash_attn_func(q, k, v, s_aux=sinks, **options)
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.stack([flash_reference(q[b], k[b], v[b], sinks=sinks, **options) for b in range(batch)])
    assert_matches(out, expected, TOLERANCE[dtype])


def _packed(q_lengths, kv_lengths, q_heads, kv_heads, head_dim, dtype, seed, trailing_rows=0):
    q, k, v = _tensors([(sum(q_lengths) + trailing_rows, q_heads, head_dim), (sum(kv_lengths), kv_heads, head_dim),
                        (sum(kv_lengths), kv_heads, head_dim)], dtype, seed)
    cu = [torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
          for lengths in (q_lengths, kv_lengths)]
    return q, k, v, cu[0], cu[1]


# q lengths, kv lengths, q_heads, kv_heads, head_dim, dtype, options
VARLEN_CASES = {
    # Continuous batching's varlen step: prefills, a chunk against its cache, decodes, all in one call.
    "mixed-prefill-chunk-decode": ([13, 4, 1, 1], [13, 30, 9, 1], 4, 2, 64, torch.float32, dict(causal=True)),
    "empty-sequence-among-others": ([3, 0, 5], [3, 6, 5], 2, 1, 128, torch.float32, dict(causal=True)),
    "window-sinks": ([1, 17, 1], [40, 17, 3], 4, 2, 64, torch.float32,
                     dict(causal=True, window_size=(7, 7), sinks=True)),
    "noncausal-softcap-bf16": ([6, 2], [9, 2], 8, 1, 64, torch.bfloat16, dict(softcap=3.0)),
    "learnable-sink-decode-only": ([1, 1, 1], [5, 1, 12], 2, 2, 64, torch.float32, dict(causal=True, sinks=True)),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_flash_attn_varlen_func_matches_flash_semantics(kernel, flash_reference, case):
    q_lengths, kv_lengths, q_heads, kv_heads, head_dim, dtype, options = VARLEN_CASES[case]
    q, k, v, cu_q, cu_k = _packed(q_lengths, kv_lengths, q_heads, kv_heads, head_dim, dtype, seed=len(case),
                                  trailing_rows=2)
    sinks = torch.randn(q_heads, generator=torch.Generator().manual_seed(4)).to(dtype) if options.pop("sinks", 0) else None
    sink_name = "learnable_sink" if case.startswith("learnable") else "s_aux"
    out = kernel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lengths), max(kv_lengths), **options,
                                        **{sink_name: sinks})
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(q_lengths)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if q_lengths[b]:
            expected[rows] = flash_reference(q[rows], k[keys], v[keys], sinks=sinks, **options)
    assert_matches(out, expected, TOLERANCE[dtype])
    assert torch.equal(out[sum(q_lengths):], torch.zeros_like(out[sum(q_lengths):]))  # rows past the last sequence


def test_varlen_equals_dense_per_sequence_and_is_differentiable(kernel):
    """Two sequences of one length, packed, give flash_attn_func's output; gradients reach q, k, v and the sinks."""
    q, k, v = _tensors([(2, 6, 4, 64), (2, 9, 2, 64), (2, 9, 2, 64)], torch.float32, seed=5)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6))
    for tensor in (q, k, v, sinks):
        tensor.requires_grad_(True)
    dense = kernel.flash_attn_func(q, k, v, causal=True, s_aux=sinks)
    cu_q, cu_k = torch.tensor([0, 6, 12], dtype=torch.int32), torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = kernel.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 6, 9,
                                           causal=True, s_aux=sinks)
    assert_matches(packed.view(2, 6, 4, 64), dense.detach(), 1e-6)
    packed.square().sum().backward()
    for tensor in (q, k, v, sinks):
        assert tensor.grad is not None and tensor.grad.abs().sum() > 0


REFUSALS = [
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(alibi_slopes=torch.ones(2)), "alibi_slopes"),
    (dict(return_attn_probs=True), "return_attn_probs"),
    (dict(window_size=(3, 2)), "window_size"),
    (dict(window_size=(-1, 1)), "window_size"),
    (dict(window_size=(2,)), "window_size"),
    (dict(softcap=-1.0), "softcap"),
    (dict(s_aux=torch.ones(2), learnable_sink=torch.ones(2)), "s_aux or as learnable_sink"),
]


@pytest.mark.parametrize("options, named", REFUSALS, ids=[named for _, named in REFUSALS])
def test_unsupported_arguments_are_refused(kernel, options, named):
    q, k, v = _tensors([(1, 4, 2, 64)] * 3, torch.float32, seed=7)
    with pytest.raises(ValueError, match=named):
        kernel.flash_attn_func(q, k, v, **options)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=named):
        kernel.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, **options)


def test_varlen_input_errors_name_the_argument(kernel):
    q, k, v = _tensors([(7, 2, 64)] * 3, torch.float32, seed=8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    cases = [
        (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), "block_table"),
        (dict(max_seqlen_q=3), "max_seqlen_q=3 is less than the longest sequence"),
        (dict(cu_seqlens_k=torch.tensor([0, 3, 8], dtype=torch.int32)), "cu_seqlens_k"),
        (dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), "one batch"),
        (dict(cu_seqlens_q=cu.float()), "cu_seqlens_q"),
        (dict(max_seqlen_k=-1), "max_seqlen_k"),
        (dict(q=q[None]), "q must be 3-D"),
    ]
    for change, message in cases:
        arguments = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4) | change
        with pytest.raises(ValueError, match=message):
            kernel.flash_attn_varlen_func(**arguments)


def test_transformers_reads_the_arguments_it_needs(kernel):
    """transformers passes what the parameter names announce: each option it knows, by the names it looks for."""
    for function in (kernel.flash_attn_func, kernel.flash_attn_varlen_func):
        parameters = inspect.signature(function).parameters
        for name in ("dropout_p", "softmax_scale", "causal", "window_size", "softcap", "deterministic", "s_aux",
                     "learnable_sink"):
            assert name in parameters, (function.__name__, name)
    assert {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"} <= set(
        inspect.signature(kernel.flash_attn_varlen_func).parameters)


def test_attention_forward_points_a_paged_cache_at_the_flash_api(kernel):
    q, k, v = _tensors([(1, 2, 3, 64)] * 3, torch.float32, seed=9)
    with pytest.raises(ValueError, match='attn_implementation="<org>/attention-tpu:flash_attn_varlen_func"'):
        kernel.attention_forward(torch.nn.Module(), q, k, v, None, cache=object())


@pytest.mark.slow
def test_the_flash_route_traces_into_one_graph(kernel):
    """transformers' flash route under torch.compile(fullgraph=True, dynamic=False): flash_attn_func at unbucketed
    lengths (its real offset a tensor) and flash_attn_varlen_func on the ragged kernel give the eager results."""
    q, k, v = _tensors([(1, 5, 4, 64), (1, 7, 2, 64), (1, 7, 2, 64)], torch.float32, seed=11)
    packed = _packed([3, 1], [6, 9], 4, 2, 64, torch.float32, seed=12)

    def flash_route(q, k, v, packed_q, packed_k, packed_v, cu_q, cu_k):
        return (kernel.flash_attn_func(q, k, v, causal=True),
                kernel.flash_attn_varlen_func(packed_q, packed_k, packed_v, cu_q, cu_k, 3, 9, causal=True))

    torch.compiler.reset()
    compiled = torch.compile(flash_route, fullgraph=True, dynamic=False, backend="aot_eager")(q, k, v, *packed)
    for out, expected in zip(compiled, flash_route(q, k, v, *packed)):
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
