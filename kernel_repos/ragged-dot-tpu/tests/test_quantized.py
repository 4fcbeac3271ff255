"""Quantized weights (int8 per output channel, fp8 in 128 x 128 blocks) against a reference that dequantizes first;
experts layers of int4 weights too (test_int4.py holds int4's packing and grouped matmuls).

Every kernel case runs in TPU interpret mode with race detection and
NaN-filled uninitialised memory. Shapes are odd (partial fp8 scale blocks,
K and N tails; int4's packed dims whole 64-row blocks), groups empty, picks
sentinels.
"""

import jax.numpy as jnp
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V5E, TPU7X = resolve_target("v5e"), resolve_target("tpu7x")

SCHEMES = ("int8", "fp8")


def _relative_error(out, expected):
    return ((out.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


RAGGED_CASES = {
    # m, k, n, group_sizes, tiles (None: the heuristic's)
    # K and N past one 128 block with partial last blocks; empty groups; rows past the groups.
    "odd-k-n": (40, 200, 300, [5, 0, 20, 7], None),
    # K, N and M in tiles with tails: scale blocks picked per tile.
    "tiles": (100, 300, 200, [20, 0, 45, 15], (32, 128, 128, None, 1)),
    # Two group slots per step with row chunks: each slot dequantizes its own group's block.
    "slots-chunks": (40, 136, 256, [9, 14, 0, 6], (40, 128, 128, 16, 2)),
    # Smaller than one scale block in every dim.
    "one-partial-block": (7, 72, 40, [3, 0, 4], None),
}


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", list(RAGGED_CASES))
def test_ragged_dot_matches_dequantized_reference(kernel, interpret, to_jax, quantized_weights, case, scheme,
                                                  transpose_rhs):
    m, k, n, group_sizes, tiles = RAGGED_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    lhs = torch.randn(m, k, generator=generator)
    shape = (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
    rhs, scales, _ = quantized_weights(kernel, scheme, shape, 1 if transpose_rhs else 2, generator)
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    config = None if tiles is None else kernel.gmm.tiles.TileConfig(*tiles)
    out = interpret(lambda: kernel.gmm.kernel.grouped_matmul(to_jax(lhs), to_jax(rhs),
                                                             jnp.asarray(group_sizes, jnp.int32), to_jax(scales),
                                                             transpose_rhs=transpose_rhs, config=config))
    weights = kernel.reference.dequantize_reference(rhs, scales, out_axis=1 if transpose_rhs else 2)
    expected = kernel.reference.ragged_dot_reference(lhs.double(), weights, sizes, transpose_rhs=transpose_rhs)
    assert not torch.isnan(out).any()
    assert _relative_error(out, expected) <= 1e-5
    rows = sum(group_sizes)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:]))


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gated_gate_up_takes_one_byte_weights_in_one_n_tile(kernel, interpret, to_jax, quantized_weights, scheme,
                                                            transpose_rhs):
    """The first projection with the gate in its epilogue (plan.gated_plan) on one-byte weights: all 2I columns
    one block, dequantized (fp8) or scaled per column (int8) before the gate; I = 100 ends in partial scale
    blocks."""
    m, k, intermediate, group_sizes = 40, 136, 100, [9, 0, 14, 6]
    generator = torch.Generator().manual_seed(11)
    lhs = torch.randn(m, k, generator=generator)
    shape = (len(group_sizes), 2 * intermediate, k) if transpose_rhs else (len(group_sizes), k, 2 * intermediate)
    rhs, scales, _ = quantized_weights(kernel, scheme, shape, 1 if transpose_rhs else 2, generator)
    problem = kernel.MatmulProblem(m, k, 2 * intermediate, len(group_sizes), "float32",
                                   jnp.dtype(to_jax(rhs).dtype).name, transpose_rhs=transpose_rhs,
                                   zero_rows_past_groups=False)
    plan = kernel.gmm.plan.make(problem, V5E, kernel.gmm.tiles.TileConfig(40, k, 2 * intermediate, None, 1))
    plan = kernel.gmm.plan.gated_plan(plan, kernel.problem.Gate("silu"), V5E)
    assert plan.tile_n == plan.problem.n == intermediate
    out = interpret(lambda: kernel.gmm.kernel.call(to_jax(lhs), to_jax(rhs), jnp.asarray(group_sizes, jnp.int32),
                                                   plan, to_jax(scales)))
    weights = kernel.reference.dequantize_reference(rhs, scales, out_axis=1 if transpose_rhs else 2)
    projected = kernel.reference.ragged_dot_reference(lhs.double(), weights, torch.tensor(group_sizes, dtype=torch.int32),
                                                      transpose_rhs=transpose_rhs)
    gate, up = projected.chunk(2, dim=1)
    rows = sum(group_sizes)
    expected = (torch.nn.functional.silu(gate) * up)[:rows]
    assert _relative_error(out[:rows], expected) <= 1e-5


LAYER_CASES = {
    # tokens, hidden, intermediate, experts, top_k, layer options, gate, fused tiles (None: fused.tiles.select's)
    # Qwen3-MoE / Mixtral layout, H and 2I past one 128 block with partial last blocks; some experts without picks.
    "concatenated": (9, 200, 136, 8, 2, dict(transposed=False, bias=False), dict(activation="silu"), None),
    # Transposed weights with biases.
    "transposed-biases": (13, 136, 72, 6, 3, dict(transposed=True, bias=True), dict(activation="gelu_tanh"), None),
    # GPT-OSS: transposed, interleaved, clamped SwiGLU, biases.
    "gpt-oss": (11, 136, 72, 8, 3, dict(transposed=True, bias=True, std=0.6),
                dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0), None),
    # Expert-parallel router masking: most picks other ranks' sentinels.
    "sentinels": (32, 64, 48, 16, 4, dict(transposed=False, bias=True, sentinels=0.8), dict(activation="silu"), None),
    # I in two tiles of the fused kernel: gate and up as separate blocks, each dequantized at its offset.
    "i-tiles": (20, 136, 256, 4, 2, dict(transposed=False, bias=True), dict(activation="silu"), (16, 128)),
    "i-tiles-interleaved": (20, 136, 192, 4, 2, dict(transposed=True, bias=True, std=0.6),
                            dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0), (16, 64)),
    # Two experts per step, each slot with its own scales (int8) or scale grids (fp8), the fp8 scratch shared.
    "experts-per-step": (40, 136, 72, 5, 2, dict(transposed=False, bias=True), dict(activation="silu"), (16, 72, 2)),
    # Gemma 4's down_proj layout: [E, H, I] with I off the 128 lanes, which the kernels read swapped
    # (weights_orientation), fp8 block scales swapped with it; gate_up [E, 2I, H] (H = 256) as given.
    "swapped-down": (9, 256, 72, 6, 2, dict(transposed=False, bias=True), dict(activation="gelu_tanh"), None),
}
# int4 packs whole 64-row blocks along the dim the kernels read on sublanes: (hidden, intermediate, fused tiles) of
# the layer cases it runs, each unpacking its blocks where int8 scales and fp8 dequantizes them.
INT4_SIZES = {
    "gpt-oss": (128, 64, None),
    # gate_up [E, 128, 64] is stored swapped: packed along H.
    "sentinels": (64, 64, None),
    "i-tiles": (128, 256, (16, 128)),
    # down [E, I, H] cut along its packed rows: 64-row tiles, one packed block each.
    "i-tiles-interleaved": (128, 192, (16, 64)),
    "experts-per-step": (128, 64, (16, 64, 2)),
    # down [E, H, I] stored swapped: packed along I.
    "swapped-down": (256, 192, None),
}
LAYER_SCHEMES = (*SCHEMES, "int4")


def _layer_row(case, scheme):
    """LAYER_CASES[case] at the sizes `scheme` takes."""
    tokens, hidden, intermediate, experts, top_k, options, gate, tiles = LAYER_CASES[case]
    if scheme == "int4":
        hidden, intermediate, tiles = INT4_SIZES[case]
    return tokens, hidden, intermediate, experts, top_k, options, gate, tiles


def _layer_params(cases, schemes=LAYER_SCHEMES):
    """(case, scheme) for each of `cases` and each of `schemes` that runs it."""
    return [pytest.param(case, scheme, id=f"{case}-{scheme}") for case in cases for scheme in schemes
            if scheme != "int4" or case in INT4_SIZES]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "scheme"), _layer_params(LAYER_CASES))
def test_experts_layer_matches_dequantized_reference(kernel, case, scheme, experts_layer_paths):
    """Both paths of experts_layer (the fused kernel and the grouped matmuls) against the float64 reference."""
    fused, grouped, expected = experts_layer_paths(kernel, scheme, _layer_row(case, scheme))
    assert not torch.isnan(fused).any() and not torch.isnan(grouped).any()
    assert _relative_error(fused, expected) <= 1e-5
    assert _relative_error(grouped, expected) <= 1e-5


@pytest.mark.parametrize("scheme", LAYER_SCHEMES)
def test_interleaved_body_slabs_take_their_scales_and_dequantized_blocks(kernel, interpret, to_jax, scheme,
                                                                         quantized_layer, dequantized_layer,
                                                                         monkeypatch):
    """GPT-OSS's layout, the whole I in two slabs (fused.tiles.MAX_SLAB_I lowered): each slab reads its columns of
    the int8 block and scales, of the fp8 block dequantized in VMEM, or of the int4 blocks unpacked and their
    scales."""
    monkeypatch.setattr(kernel.fused.tiles, "MAX_SLAB_I", 128)
    tokens, _, _, experts, top_k, options, gate, _ = LAYER_CASES["gpt-oss"]
    layer = quantized_layer(kernel, scheme, tokens, 128, 256, experts, top_k, **options)
    gate = dict(weights_transposed=True, **gate)
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    plan = kernel.fused.plan.make(problem, resolve_target())
    assert (plan.tile_i, plan.slab_i) == (256, 128)
    expected = kernel.reference.gated_experts_reference(*dequantized_layer(kernel, layer, True), **gate)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate))
    assert not torch.isnan(fused).any()
    assert _relative_error(fused, expected) <= 1e-5


# int4 in one case only: each case costs the suite about 10 s.
V5P_SHARED_CASES = [*_layer_params(["i-tiles"]), *_layer_params(["i-tiles-interleaved"], SCHEMES)]


@pytest.mark.parametrize(("case", "scheme"), V5P_SHARED_CASES)
def test_v5p_cores_sharing_each_expert_read_their_own_i_tiles(kernel, case, scheme, fused_on_v5p_cores_sharing_experts):
    """cores_per_expert 2 on two simulated cores: each dequantizes (fp8), unpacks (int4) or scales (int8) the I
    tiles it owns, at their offsets into the expert's scales; three tiles leave the second core an empty step."""
    fused, expected = fused_on_v5p_cores_sharing_experts(kernel, scheme, _layer_row(case, scheme))
    assert not torch.isnan(fused).any()
    assert _relative_error(fused, expected) <= 1e-5


@pytest.mark.slow
def test_fp8_bf16_layer_is_the_unquantized_kernel_on_transformers_dequantized_weights(kernel, interpret, to_jax,
                                                                                     quantized_layer):
    """bf16 activations: fp8 weights dequantized in VMEM as transformers does on load ((q.f32 * s).to(bf16))
    give the unquantized bf16 kernel's output on those weights, bit for bit, on both paths."""
    layer = quantized_layer(kernel, "fp8", 24, 136, 192, 8, 2, transposed=False, bias=False,
                            dtype=torch.bfloat16)
    *front, gate_up, down, _, _, gate_up_scales, down_scales = layer
    dequantized = [kernel.reference.dequantize_reference(w, s, out_axis=1).to(torch.bfloat16)
                   for w, s in ((gate_up, gate_up_scales), (down, down_scales))]
    gate = dict(activation="silu", weights_transposed=False)
    for fused in (True, False):
        quantized = interpret(lambda: kernel.experts_layer(*map(to_jax, layer), **gate, fused=fused))
        plain = interpret(lambda: kernel.experts_layer(*map(to_jax, (*front, *dequantized)), **gate, fused=fused))
        assert torch.equal(quantized, plain), f"fused={fused}"


@pytest.mark.parametrize("scheme", LAYER_SCHEMES)
def test_only_sentinel_picks_give_zeros(kernel, interpret, to_jax, scheme, quantized_layer):
    layer = quantized_layer(kernel, scheme, 6, 64, 256, 8, 2, transposed=False, bias=True, sentinels=1.0)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), activation="silu",
                                                                 weights_transposed=False))
    assert torch.equal(fused, torch.zeros_like(fused))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_torch_ops_take_quantized_weights(kernel, scheme, quantized_weights, quantized_layer, dequantized_layer):
    """The checked torch ops, end to end: ragged_dot and gated_experts with int8 / fp8 weights and their scales."""
    generator = torch.Generator().manual_seed(3)
    lhs = torch.randn(12, 136, generator=generator).bfloat16()
    rhs, scales, _ = quantized_weights(kernel, scheme, (3, 136, 200), 2, generator)
    sizes = torch.tensor([5, 0, 7], dtype=torch.int32)
    out = kernel.ragged_dot(lhs, rhs, sizes, rhs_scales=scales)
    weights = kernel.reference.dequantize_reference(rhs, scales, out_axis=2)
    expected = kernel.reference.ragged_dot_reference(lhs.double(), weights, sizes)
    assert out.dtype == torch.bfloat16
    assert _relative_error(out, expected) < 2e-2  # bf16 activations and output

    layer = quantized_layer(kernel, scheme, 5, 64, 48, 4, 2, transposed=False, bias=False)
    hidden, index, routing, gate_up, down, _, _, gate_up_scales, down_scales = layer
    out = kernel.gated_experts(hidden, index, routing, gate_up, down, gate_up_scales=gate_up_scales,
                               down_scales=down_scales, activation="silu", weights_transposed=False)
    expected = kernel.reference.gated_experts_reference(*dequantized_layer(kernel, layer, False), activation="silu",
                                                        weights_transposed=False)
    assert _relative_error(out, expected) <= 1e-5


def _bad_scales_calls(rhs_dtype):
    int8 = rhs_dtype == torch.int8
    good = torch.ones(2, 32) if int8 else torch.ones(2, 1, 1)
    return [
        (dict(rhs_scales=None), ValueError, "needs rhs_scales"),
        (dict(rhs_scales=torch.ones(2, 31) if int8 else torch.ones(2, 2, 1)), ValueError, "rhs_scales must be"),
        (dict(rhs_scales=good.double()), TypeError, "rhs_scales must be float32"),
        (dict(rhs_scales=good.view(-1)), ValueError, "rhs_scales must be"),
    ]


@pytest.mark.parametrize("rhs_dtype", [torch.int8, torch.float8_e4m3fn])
def test_bad_scales_are_refused(kernel, rhs_dtype):
    rhs = torch.ones(2, 16, 32).to(rhs_dtype)
    args = dict(lhs=torch.randn(8, 16), rhs=rhs, group_sizes=torch.tensor([4, 4], dtype=torch.int32))
    for change, error, match in _bad_scales_calls(rhs_dtype):
        with pytest.raises(error, match=match):
            kernel.ragged_dot(**{**args, **change})
    with pytest.raises(ValueError, match="rhs_scales are for int8, float8_e4m3fn or uint8"):
        kernel.ragged_dot(**args | dict(rhs=torch.randn(2, 16, 32)), rhs_scales=torch.ones(2, 32))
    with pytest.raises(TypeError, match=r"rhs must be float32, bfloat16, int8, float8_e4m3fn or uint8 \(packed int4\)"):
        kernel.ragged_dot(**args | dict(rhs=rhs.to(torch.int16)), rhs_scales=torch.ones(2, 32))


def test_gated_experts_refuses_bad_scales(kernel, quantized_layer):
    layer = quantized_layer(kernel, "fp8", 4, 64, 48, 4, 2, transposed=False, bias=False)
    hidden, index, routing, gate_up, down, _, _, gate_up_scales, down_scales = layer
    args = dict(hidden_states=hidden, top_k_index=index, top_k_weights=routing, gate_up_proj=gate_up,
                down_proj=down, gate_up_scales=gate_up_scales, down_scales=down_scales)
    calls = [
        (dict(down_scales=None), ValueError, "down_scales"),
        (dict(gate_up_scales=gate_up_scales[:, :, :0]), ValueError, r"gate_up_scales must be \[4, 1, 1\]"),
        (dict(down_proj=down.view(torch.int8)), TypeError, "must share one dtype"),
        (dict(gate_up_proj=gate_up.float(), down_proj=down.float()), ValueError, "scales are for int8"),
    ]
    for change, error, match in calls:
        with pytest.raises(error, match=match):
            kernel.gated_experts(**args | change, activation="silu", weights_transposed=False)


def test_quantized_weights_run_under_autograd_and_refuse_a_backward(kernel, quantized_weights, quantized_layer):
    """A forward with gradients enabled (as a plain model call makes) runs; asking for a gradient through
    one-byte weights raises the refusal, never a wrong or silent gradient."""
    generator = torch.Generator().manual_seed(5)
    lhs = torch.randn(12, 136, generator=generator, requires_grad=True)
    rhs, scales, _ = quantized_weights(kernel, "int8", (3, 136, 200), 2, generator)
    out = kernel.ragged_dot(lhs, rhs, torch.tensor([5, 0, 7], dtype=torch.int32), rhs_scales=scales)
    with pytest.raises(NotImplementedError, match="ragged_dot: no gradient through int8 / float8_e4m3fn / packed int4 weights"):
        out.sum().backward()

    hidden, index, routing, gate_up, down, _, _, gate_up_scales, down_scales = quantized_layer(
        kernel, "fp8", 5, 64, 48, 4, 2, transposed=False, bias=False)
    hidden.requires_grad_(True)
    out = kernel.gated_experts(hidden, index, routing, gate_up, down, gate_up_scales=gate_up_scales,
                               down_scales=down_scales, activation="silu", weights_transposed=False)
    with torch.no_grad():
        expected = kernel.gated_experts(hidden, index, routing, gate_up, down, gate_up_scales=gate_up_scales,
                                        down_scales=down_scales, activation="silu", weights_transposed=False)
    assert torch.equal(out.detach(), expected)
    with pytest.raises(NotImplementedError, match="gated_experts: no gradient through int8 / float8_e4m3fn / packed int4"):
        out.sum().backward()


# On TPU7x the fused kernel multiplies fp8 weights with fp8 activations (plan.fp8_matmul), in either gate/up
# layout, unless I tiles would cut the down projection's scale blocks (I tiles of 64 here).
FP8_MXU_CASES = {"concatenated": True, "transposed-biases": True, "sentinels": True, "i-tiles": True,
                 "experts-per-step": True, "swapped-down": True, "gpt-oss": True, "i-tiles-interleaved": False,
                 "partial-i-tile": True, "partial-i-tile-wide": True, "gpt-oss-wide": True}
FP8_MXU_LAYER_CASES = {
    **LAYER_CASES,
    # GPT-OSS's layout in I tiles of whole scale blocks that do not divide I (fused/tiles.py's partial_i_tiles): 128,
    # 128 and a last tile of 64 columns past which the weights and biases are garbage (NaN in the interpreter).
    "partial-i-tile": (20, 136, 320, 4, 2, dict(transposed=True, bias=True, std=0.6),
                       dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0), (16, 128)),
    # 256 and 192: the last tile's first K block whole, its second half garbage.
    "partial-i-tile-wide": (13, 136, 448, 3, 2, dict(transposed=True, bias=True, std=0.6),
                            dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0), (16, 256)),
    # I = 200: 400 interleaved columns, de-interleaved as 256 + 144, the down projection's K blocks 128 + 72.
    "gpt-oss-wide": (7, 136, 200, 3, 2, dict(transposed=True, bias=True, std=0.6),
                     dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(FP8_MXU_CASES))
def test_fused_fp8_on_tpu7x_feeds_fp8_activations_to_the_mxu(kernel, interpret, to_jax, case, quantized_layer,
                                                             dequantized_layer):
    """Against the reference that quantizes each matmul's activations per row and 128-wide K block as the kernel
    does; where the path is taken, the result differs from the dequantizing path's (the activations were
    quantized), else it is that path's."""
    tokens, hidden, intermediate, experts, top_k, options, gate, tiles = FP8_MXU_LAYER_CASES[case]
    transposed = options["transposed"]
    layer = quantized_layer(kernel, "fp8", tokens, hidden, intermediate, experts, top_k, **options)
    gate = dict(weights_transposed=transposed, **gate)
    config = None if tiles is None else kernel.fused.tiles.FusedConfig(*tiles)
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    assert kernel.fused.plan.make(problem, TPU7X, config).fp8_matmul == FP8_MXU_CASES[case]
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate, config=config,
                                                   generation="tpu7x"))
    dequantized = dequantized_layer(kernel, layer, transposed)
    weights_only = kernel.reference.gated_experts_reference(*dequantized, **gate)
    assert not torch.isnan(fused).any()
    if not FP8_MXU_CASES[case]:
        assert _relative_error(fused, weights_only) <= 1e-5
        return
    expected = kernel.reference.gated_experts_reference(*dequantized, **gate, fp8_activations=True)
    assert _relative_error(fused, expected) <= 1e-5
    assert _relative_error(fused, weights_only) > 1e-3


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", list(RAGGED_CASES))
def test_ragged_dot_fp8_on_tpu7x_feeds_fp8_activations_to_the_mxu(kernel, interpret, to_jax, quantized_weights, case,
                                                                  transpose_rhs):
    """On TPU7x the grouped matmul multiplies the rows, quantized to fp8 per row and 128-wide K block, with the fp8
    weights as they are: against a reference that rounds the rows the same way, and not the weights-only result
    (the path really ran)."""
    m, k, n, group_sizes, tiles = RAGGED_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    lhs = torch.randn(m, k, generator=generator)
    shape = (len(group_sizes), n, k) if transpose_rhs else (len(group_sizes), k, n)
    rhs, scales, _ = quantized_weights(kernel, "fp8", shape, 1 if transpose_rhs else 2, generator)
    sizes = torch.tensor(group_sizes, dtype=torch.int32)
    config = None if tiles is None else kernel.gmm.tiles.TileConfig(*tiles)
    problem = kernel.MatmulProblem(m, k, n, len(group_sizes), "float32", "float8_e4m3fn",
                                   transpose_rhs=transpose_rhs)
    assert kernel.gmm.plan.make(problem, TPU7X, config).fp8_matmul
    out = interpret(lambda: kernel.gmm.kernel.grouped_matmul(to_jax(lhs), to_jax(rhs),
                                                             jnp.asarray(group_sizes, jnp.int32), to_jax(scales),
                                                             transpose_rhs=transpose_rhs, config=config,
                                                             generation="tpu7x"))
    weights = kernel.reference.dequantize_reference(rhs, scales, out_axis=1 if transpose_rhs else 2)
    fp8_rows = torch.stack([kernel.reference.fp8_rows_reference(row) for row in lhs])
    expected = kernel.reference.ragged_dot_reference(fp8_rows, weights, sizes, transpose_rhs=transpose_rhs)
    weights_only = kernel.reference.ragged_dot_reference(lhs.double(), weights, sizes, transpose_rhs=transpose_rhs)
    assert not torch.isnan(out).any()
    assert _relative_error(out, expected) <= 1e-5
    assert _relative_error(out, weights_only) > 1e-3
    rows = sum(group_sizes)
    assert torch.equal(out[rows:], torch.zeros_like(out[rows:]))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["concatenated", "transposed-biases", "gpt-oss", "sentinels", "swapped-down"])
def test_grouped_fp8_layer_on_tpu7x_feeds_fp8_activations_to_the_mxu(kernel, interpret, to_jax, case, quantized_layer,
                                                                     dequantized_layer):
    """The grouped path of the experts layer on TPU7x (both projections on the fp8 MXU, GPT-OSS's interleaved
    layout too: its rows are quantized before the columns interleave) against the reference that quantizes each
    matmul's activations as the kernels do."""
    tokens, hidden, intermediate, experts, top_k, options, gate, _ = LAYER_CASES[case]
    transposed = options["transposed"]
    layer = quantized_layer(kernel, "fp8", tokens, hidden, intermediate, experts, top_k, **options)
    gate = dict(weights_transposed=transposed, **gate)
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    plan = kernel.plan.plan_experts(problem, TPU7X, fused=False)
    assert plan.gate_up.fp8_matmul and plan.down.fp8_matmul
    grouped = interpret(lambda: kernel.experts_layer(*map(to_jax, layer), **gate, fused=False,
                                                     generation="tpu7x"))
    dequantized = dequantized_layer(kernel, layer, transposed)
    expected = kernel.reference.gated_experts_reference(*dequantized, **gate, fp8_activations=True)
    assert not torch.isnan(grouped).any()
    assert _relative_error(grouped, expected) <= 1e-5
    assert _relative_error(grouped, kernel.reference.gated_experts_reference(*dequantized, **gate)) > 1e-3
