"""Backward of ragged_dot and of the experts layer, in TPU interpret mode with race detection.

Gradients are checked against torch autograd through the float64 references
(`reference.py`) on random inputs with odd sizes, empty groups and rows past
the groups: relative error at most 1e-5 in float32 and 2e-2 in bfloat16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V5E, V5P, V6E = resolve_target("v5e"), resolve_target("v5p"), resolve_target("v6e")


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


def _relative_error(out, expected):
    return ((out.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()


TGMM_CASES = {
    # m, k, n, group_sizes, config (tile_m, tile_k, tile_n, chunk_m) or None for the heuristic
    "one-row": (1, 96, 200, [0, 1, 0], None),
    "odd-sizes-empty-groups": (37, 72, 130, [5, 0, 11, 0, 9, 0], None),
    "rows-past-groups": (64, 128, 96, [10, 0, 30], None),
    # 3 row tiles of 32 in chunks of 16; groups straddle tiles and chunks; K and N in tiles with tails;
    # rows 90..99 past the groups; an empty group between two that share a row tile.
    "tiles-and-chunks": (100, 300, 200, [20, 0, 45, 0, 25, 0], (32, 128, 128, 16)),
    # Chunks laid from each group's first row (off the 16-row grid: 5, 42, 112, 162 rows in), windows of
    # 32 + 16 rows; chunks running past a tile's end are multiplied whole by the tile where they start.
    "group-chunks": (200, 128, 130, [5, 37, 0, 70, 50, 20, 0], (32, 128, 128, 16, True)),
    # The same with K and N in tiles with tails, and rows past the groups.
    "group-chunks-k-n-tiles": (120, 300, 200, [9, 0, 40, 33, 0], (48, 128, 128, 16, True)),
    "all-groups-empty": (24, 128, 128, [0, 0, 0], (16, 128, 128, 16)),
    "leading-empty-groups": (48, 128, 128, [0, 0, 17, 31], (16, 128, 128, 16)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", TGMM_CASES)
def test_tgmm_matches_reference(kernel, interpret, to_jax, case, dtype):
    m, k, n, group_sizes, config = TGMM_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    lhs = torch.randn(m, k, generator=generator).to(dtype)
    rhs = torch.randn(m, n, generator=generator).to(dtype)
    rows = sum(group_sizes)
    # Rows past the groups must contribute nothing, whatever they hold.
    lhs[rows:], rhs[rows:] = float("nan"), float("nan")
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    config = None if config is None else kernel.tgmm.tiles.TgmmConfig(*config)
    out = interpret(lambda: kernel.tgmm.kernel.transposed_grouped_matmul(to_jax(lhs), to_jax(rhs), to_jax(sizes),
                                                                         config=config))
    expected = kernel.reference.tgmm_reference(lhs, rhs, sizes)
    assert out.shape == (len(group_sizes), k, n)
    assert not torch.isnan(out).any()
    assert _relative_error(out, expected) <= _tolerance(dtype)
    for group, size in enumerate(group_sizes):
        if size == 0:
            assert torch.equal(out[group], torch.zeros_like(out[group])), "an empty group's gradient must be zero"


@pytest.mark.parametrize("k,n", [(256, 384), (400, 256)])
def test_tgmm_split_for_v5p_cores_matches_reference(kernel, interpret, to_jax, k, n):
    """v5p's heuristic cuts the one output block per group in two (N, or K when K is the larger), tails
    partial."""
    config = kernel.tgmm.tiles.select(kernel.TgmmProblem(80, k, n, 3, "float32", "float32"), V5P)
    assert (-(-k // config.tile_k)) * (-(-n // config.tile_n)) == 2
    generator = torch.Generator().manual_seed(k)
    lhs, rhs = torch.randn(80, k, generator=generator), torch.randn(80, n, generator=generator)
    sizes = torch.tensor([30, 0, 41], dtype=torch.int32)
    out = interpret(lambda: kernel.tgmm.kernel.transposed_grouped_matmul(to_jax(lhs), to_jax(rhs), to_jax(sizes),
                                                                         generation="v5p"))
    assert _relative_error(out, kernel.reference.tgmm_reference(lhs, rhs, sizes)) <= 1e-5


def test_tgmm_items_skip_rows_past_groups_and_fetch_nothing_for_empty_groups(kernel):
    items = kernel.tgmm.kernel.make_tgmm_items(jnp.asarray([0, 20, 0, 45, 0], jnp.int32), 100, 32)
    count = int(items.count[0])
    # Group 1 spans row tile 0; group 3 rows 20..64, tiles 0..2; empty groups one item each.
    assert count == 1 + 1 + 1 + 3 + 1
    assert list(np.asarray(items.group[:count])) == [0, 1, 2, 3, 3, 3, 4]
    # Empty groups keep the row tile of the item before them; nothing reaches tile 3 (rows 96..99).
    assert list(np.asarray(items.row_tile[:count])) == [0, 0, 0, 0, 1, 2, 2]


def test_tgmm_group_chunks_start_at_group_starts(kernel):
    # Group 1: rows 5..40 (chunks of 16 from row 0: 0, 16, 32); group 2: rows 40..100 (from 40: 40, 56, 72, 88).
    items = kernel.tgmm.kernel.make_tgmm_items(jnp.asarray([5, 35, 60], jnp.int32), 100, 32, chunk_m=16, align=8)
    count = int(items.count[0])
    assert list(np.asarray(items.group[:count])) == [0, 1, 1, 2, 2, 2]
    assert list(np.asarray(items.row_tile[:count])) == [0, 0, 1, 1, 2, 3]
    # Tile-relative first chunk of the item's group starting in its tile: group 1's chunk at row 32 in
    # tile 1 (rows 32..63) is at 0; group 2's chunks at 40, 56 (tile 1: 8), 72, 88 (tile 2: 8); in tile 3
    # the next would start at 104, past the group's rows, so that item multiplies nothing.
    assert list(np.asarray(items.chunk_start[:count])) == [0, 0, 0, 8, 8, 8]


def test_tgmm_heuristic_takes_group_chunks_where_the_mxu_bounds_it(kernel):
    """Training shapes: v5e's MXU bounds tgmm (group chunks halve the waste per group); v6e's HBM does."""
    problem = kernel.TgmmProblem(65536, 1536, 2048, 128, "bfloat16", "bfloat16")
    assert kernel.tgmm.tiles.select(problem, V5E).group_chunks
    assert not kernel.tgmm.tiles.select(problem, V6E).group_chunks


RAGGED_DOT_CASES = [
    # m, k, n, group_sizes, transpose_rhs
    (1, 96, 200, [0, 1], False),
    (37, 72, 130, [5, 0, 11, 0, 9, 0], True),
    (64, 128, 96, [10, 0, 30], False),
    (129, 200, 96, [50, 0, 0, 60], True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n,group_sizes,transpose_rhs", RAGGED_DOT_CASES)
def test_ragged_dot_gradients_match_reference(kernel, m, k, n, group_sizes, transpose_rhs, dtype):
    generator = torch.Generator().manual_seed(m + k)
    lhs = torch.randn(m, k, generator=generator).to(dtype).requires_grad_()
    shape = (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
    rhs = torch.randn(shape, generator=generator).to(dtype).requires_grad_()
    d_out = torch.randn(m, n, generator=generator).to(dtype)
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    kernel.ragged_dot(lhs, rhs, sizes, transpose_rhs=transpose_rhs).backward(d_out)

    lhs64, rhs64 = lhs.detach().double().requires_grad_(), rhs.detach().double().requires_grad_()
    kernel.reference.ragged_dot_reference(lhs64, rhs64, sizes, transpose_rhs=transpose_rhs).backward(d_out.double())
    for grad, expected in ((lhs.grad, lhs64.grad), (rhs.grad, rhs64.grad)):
        assert grad.dtype == dtype and grad.shape == expected.shape
        assert not torch.isnan(grad).any()
        assert _relative_error(grad, expected) <= _tolerance(dtype)
    rows = sum(group_sizes)
    assert torch.equal(lhs.grad[rows:], torch.zeros_like(lhs.grad[rows:])), "rows past the groups get no gradient"


@pytest.mark.slow
def test_ragged_dot_gradient_in_jax(kernel, interpret, to_jax):
    """jax.grad through the custom_vjp runs the backward kernels (rows past the groups hold NaN and stay out)."""
    generator = torch.Generator().manual_seed(5)
    lhs, rhs = torch.randn(45, 72, generator=generator), torch.randn(4, 72, 50, generator=generator)
    lhs[40:] = float("nan")
    d_out = torch.randn(45, 50, generator=generator)
    sizes = torch.tensor([12, 0, 20, 8], dtype=torch.int32)

    def loss(lhs, rhs):
        out = kernel.backward.differentiable_ragged_dot(lhs, rhs, to_jax(sizes), False, False, None)
        return jnp.sum(jnp.where(jnp.arange(45)[:, None] < 40, out, 0.0) * to_jax(d_out))

    d_rhs = interpret(lambda: jax.grad(loss, argnums=1)(to_jax(lhs), to_jax(rhs)))
    lhs64, rhs64 = lhs.double().nan_to_num(), rhs.double().requires_grad_()
    kernel.reference.ragged_dot_reference(lhs64, rhs64, sizes).backward(d_out.double())
    assert _relative_error(d_rhs, rhs64.grad) <= 1e-5


NUM_EXPERTS = 6
EXPERTS_CASES = {
    # name: (activation, weights_transposed, interleaved, biases, alpha, limit)
    "silu": ("silu", False, False, False, 1.0, float("inf")),
    "gelu-tanh-transposed": ("gelu_tanh", True, False, False, 1.0, float("inf")),
    # GPT-OSS: clamped interleaved SwiGLU with biases; a small limit so the clamps bite.
    "gpt-oss": ("clamped_swiglu", True, True, True, 1.702, 1.0),
}
# Shapes whose down_proj XLA stores with its last two dims swapped, read (and differentiated) as that view
# (weights_orientation): Gemma 4's [E, H, I] with I off the lanes, and a transposed [E, I, H].
SWAPPED_DOWN_SHAPES = {"gelu-tanh-transposed": dict(hidden=40, intermediate=128),
                       "silu": dict(hidden=128, intermediate=24)}


def _experts_inputs(dtype, tokens=13, hidden=40, intermediate=24, top_k=3, weights_transposed=False, biases=False,
                    sentinels=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Experts 1 and 4 get no pick: empty groups.
    choices = torch.tensor([0, 2, 3, 5])
    index = torch.stack([choices[torch.randperm(4, generator=generator)[:top_k]] for _ in range(tokens)])
    index.view(-1)[:sentinels] = NUM_EXPERTS
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    gate_up_shape = (NUM_EXPERTS, hidden, 2 * intermediate) if weights_transposed else (
        NUM_EXPERTS, 2 * intermediate, hidden)
    down_shape = (NUM_EXPERTS, intermediate, hidden) if weights_transposed else (NUM_EXPERTS, hidden, intermediate)
    tensors = dict(
        hidden_states=torch.randn(tokens, hidden, generator=generator),
        top_k_weights=weights,
        gate_up_proj=torch.randn(gate_up_shape, generator=generator) * 0.3,
        down_proj=torch.randn(down_shape, generator=generator) * 0.3,
    )
    if biases:
        tensors.update(gate_up_bias=torch.randn(NUM_EXPERTS, 2 * intermediate, generator=generator) * 0.3,
                       down_bias=torch.randn(NUM_EXPERTS, hidden, generator=generator) * 0.3)
    tensors = {name: tensor.to(dtype).requires_grad_() for name, tensor in tensors.items()}
    return index, tensors


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [*EXPERTS_CASES, *(f"{name}-swapped-down" for name in SWAPPED_DOWN_SHAPES)])
def test_gated_experts_gradients_match_reference(kernel, case, dtype):
    name = case.removesuffix("-swapped-down")
    activation, weights_transposed, interleaved, biases, alpha, limit = EXPERTS_CASES[name]
    shape = SWAPPED_DOWN_SHAPES[name] if case != name else {}
    if shape:
        orientation = kernel.common.weights_layout.weights_orientation(**shape, weights_transposed=weights_transposed)
        assert orientation.down_transposed != weights_transposed, "the case must read down_proj swapped"
    index, tensors = _experts_inputs(dtype, weights_transposed=weights_transposed, biases=biases, **shape)
    if activation == "clamped_swiglu" and dtype == torch.bfloat16:
        # A clamp's gradient jumps at the limit. With ~1700 pre-activations of std ~2 and bf16's rounding of
        # 2^-8 to 2^-7, a few fall on the other side of a limit of 1 than in the float64 reference, and their
        # gradients differ by O(1) however exact both are: float32 checks the clamps biting; bf16 takes
        # GPT-OSS's own limit, which they reach rarely.
        limit = 7.0
    gate = dict(activation=activation, weights_transposed=weights_transposed, interleaved=interleaved, alpha=alpha,
                limit=limit)
    out = kernel.gated_experts(
        tensors["hidden_states"], index, tensors["top_k_weights"], tensors["gate_up_proj"], tensors["down_proj"],
        tensors.get("gate_up_bias"), tensors.get("down_bias"), **gate)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    out.backward(d_out)

    reference = {name: tensor.detach().double().requires_grad_() for name, tensor in tensors.items()}
    expected_out = kernel.reference.gated_experts_reference(
        reference["hidden_states"], index, reference["top_k_weights"], reference["gate_up_proj"],
        reference["down_proj"], reference.get("gate_up_bias"), reference.get("down_bias"), **gate)
    expected_out.backward(d_out.double())
    assert _relative_error(out, expected_out) <= _tolerance(dtype)
    for name, tensor in tensors.items():
        assert tensor.grad.dtype == dtype and tensor.grad.shape == tensor.shape, name
        assert not torch.isnan(tensor.grad).any(), name
        assert _relative_error(tensor.grad, reference[name].grad) <= _tolerance(dtype), name
    sentinel = index == NUM_EXPERTS
    assert torch.equal(tensors["top_k_weights"].grad[sentinel], torch.zeros(int(sentinel.sum()), dtype=dtype))


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_experts_layer_jax_gradient_on_either_forward_path(kernel, interpret, to_jax, fused):
    """jax.grad of experts_layer: the decode-sized call the rule would give the fused kernel, forced
    either way, differentiates through the grouped formulation (GPT-OSS gate, biases, sentinels)."""
    index, tensors = _experts_inputs(torch.float32, tokens=5, weights_transposed=True, biases=True, sentinels=2)
    gate = dict(activation="clamped_swiglu", weights_transposed=True, interleaved=True, alpha=1.702, limit=1.0)
    d_out = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    names = list(tensors)

    def loss(*arrays):
        args = dict(zip(names, arrays))
        out = kernel.experts_layer(args["hidden_states"], to_jax(index), args["top_k_weights"],
                                   args["gate_up_proj"], args["down_proj"], args["gate_up_bias"],
                                   args["down_bias"], **gate, fused=fused)
        return jnp.sum(out * to_jax(d_out))

    arrays = [to_jax(tensor.detach()) for tensor in tensors.values()]
    # All gradients in one run, flattened into one array (the interpret fixture returns one).
    flat = interpret(lambda: jnp.concatenate(
        [grad.ravel() for grad in jax.grad(loss, argnums=tuple(range(len(arrays))))(*arrays)]))
    grads = [part.reshape(array.shape) for part, array in zip(
        torch.split(flat, [array.size for array in arrays]), arrays)]
    reference = {name: tensor.detach().double().requires_grad_() for name, tensor in tensors.items()}
    kernel.reference.gated_experts_reference(
        reference["hidden_states"], index, reference["top_k_weights"], reference["gate_up_proj"],
        reference["down_proj"], reference["gate_up_bias"], reference["down_bias"], **gate).backward(d_out.double())
    for name, grad in zip(names, grads):
        assert _relative_error(grad, reference[name].grad) <= 1e-5, name


def _gpt_oss_experts(custom_gate: bool):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    class TanhGateExperts(GptOssExperts):
        """A gate the fused op does not know: experts_forward composes torch ops around ragged_dot."""

        def _apply_gate(self, gate_up):
            return torch.tanh(gate_up[..., ::2]) * gate_up[..., 1::2]

    config = GptOssConfig(hidden_size=40, intermediate_size=24, num_local_experts=NUM_EXPERTS, num_experts_per_tok=3)
    config._experts_implementation = "eager"
    torch.manual_seed(1)
    experts = (TanhGateExperts if custom_gate else GptOssExperts)(config)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(std=0.3)
    return experts


@pytest.mark.slow
@pytest.mark.parametrize("custom_gate,tokens,sentinels", [
    (False, 11, 4),
    (True, 11, 4),
    # 3600 picks, all but 100 of them sentinels: the grouped matmuls tile the rows (more than `ridge_rows`
    # per expert) and leave the sentinels' row tiles unwritten (NaN in interpret mode).
    (True, 1200, 3500),
], ids=["gpt-oss-gate", "composed-with-biases", "composed-unwritten-sentinel-tiles"])
def test_experts_forward_gradients_match_eager(kernel, custom_gate, tokens, sentinels):
    """experts_forward's gradients (weights, biases, hidden states, routing weights) against transformers'
    eager experts, with sentinels; on the composed path the unwritten sentinel rows must not reach the
    bias gradients through the gate's backward."""
    experts = _gpt_oss_experts(custom_gate)
    assert (kernel.fused_gate(experts) is None) == custom_gate
    index, tensors = _experts_inputs(torch.float32, tokens=tokens, sentinels=sentinels)
    hidden = tensors["hidden_states"].detach().requires_grad_()
    weights = tensors["top_k_weights"].detach().requires_grad_()
    d_out = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(2))
    kernel.experts_forward(experts, hidden, index, weights).backward(d_out)
    ours = {name: p.grad.clone() for name, p in experts.named_parameters()}
    experts.zero_grad()

    sentinel = index == NUM_EXPERTS
    eager_hidden = hidden.detach().requires_grad_()
    eager_weights = weights.detach().masked_fill(sentinel, 0.0).requires_grad_()
    experts(eager_hidden, index.clamp(max=NUM_EXPERTS - 1), eager_weights).backward(d_out)  # eager has no sentinels
    for name, parameter in experts.named_parameters():
        assert not torch.isnan(ours[name]).any(), name
        assert _relative_error(ours[name], parameter.grad) <= 1e-5, name
    assert _relative_error(hidden.grad, eager_hidden.grad) <= 1e-5
    assert _relative_error(weights.grad[~sentinel], eager_weights.grad[~sentinel]) <= 1e-5
    assert torch.equal(weights.grad[sentinel], torch.zeros(int(sentinel.sum())))
