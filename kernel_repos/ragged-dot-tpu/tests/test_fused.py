"""The fused experts kernel (fused/kernel.py's fused_experts) against the float64 reference and the grouped path.

Every case runs in TPU interpret mode with race detection and NaN-filled
uninitialised memory, through the built torch-cpu variant's JAX functions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpu_kernels.runtime.hardware import resolve_target

V5P, V6E = resolve_target("v5p"), resolve_target("v6e")


def _layer(random_picks, tokens, hidden, intermediate, experts, top_k, *, transposed, bias, dtype=torch.float32,
           weights_dtype=None, sentinels=0.0, seed=0, scale=0.2):
    """Random (never zero) inputs of one experts layer; `sentinels` of the picks go to other ranks."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=generator) * std).to(dtype)

    gate_up = randn(*((experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)),
                    std=scale)
    down = randn(*((experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)), std=scale)
    biases = (randn(experts, 2 * intermediate, std=0.5), randn(experts, hidden, std=0.5)) if bias else (None, None)
    index, weights = random_picks(generator, tokens, experts, top_k, sentinels)
    return randn(tokens, hidden), index, weights.to(weights_dtype or dtype), gate_up, down, *biases


def _relative_error(out, expected):
    return ((out.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


CASES = {
    # tokens, hidden, intermediate, experts, top_k, layer options, gate
    # Qwen3-MoE / Mixtral layout: [E, 2I, H] and [E, H, I], concatenated gate, SiLU; odd H and I.
    "concatenated": (7, 72, 40, 8, 2, dict(transposed=False, bias=False), dict(activation="silu")),
    # Transposed weights with biases, tanh GELU.
    "transposed-biases": (13, 64, 48, 6, 3, dict(transposed=True, bias=True), dict(activation="gelu_tanh")),
    # Exact GELU, one token.
    "gelu-one-token": (1, 64, 48, 4, 2, dict(transposed=False, bias=False), dict(activation="gelu")),
    # GPT-OSS: transposed, interleaved gate and up, clamped SwiGLU, biases; inputs reach the clamp.
    "gpt-oss": (13, 64, 48, 8, 3, dict(transposed=True, bias=True, scale=0.6),
                dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0)),
    # Interleaved with the plain layout.
    "interleaved-plain": (9, 64, 40, 5, 2, dict(transposed=False, bias=True), dict(activation="silu", interleaved=True)),
    # Expert-parallel router masking: most picks are other ranks' sentinels; 16 experts, several without picks.
    "sentinels": (64, 64, 48, 16, 4, dict(transposed=False, bias=True, sentinels=0.8), dict(activation="silu")),
    # A few hundred tokens: 128-row chunks, several per expert.
    "three-hundred-tokens": (300, 64, 40, 4, 2, dict(transposed=False, bias=False), dict(activation="silu")),
    # Weights XLA stores with their last two dims swapped (weights_orientation), read as that view:
    # Gemma 4's down_proj [E, H, I] with I off the 128 lanes; a transposed down_proj [E, I, H]; a gate_up.
    "swapped-down": (9, 256, 72, 6, 2, dict(transposed=False, bias=True), dict(activation="gelu_tanh")),
    "swapped-down-transposed": (9, 200, 128, 6, 2, dict(transposed=True, bias=True), dict(activation="silu")),
    "swapped-gate-up": (9, 200, 64, 6, 2, dict(transposed=False, bias=False), dict(activation="silu")),
}
SWAPPED = {"swapped-down": (False, True), "swapped-down-transposed": (True, False), "swapped-gate-up": (True, False)}


def test_swapped_cases_read_the_weights_swapped(kernel):
    """Each swapped case reads the projection it names in the order opposite to transformers' layout."""
    for case, expected in SWAPPED.items():
        tokens, hidden, intermediate, *_, options, _ = CASES[case]
        orientation = kernel.common.weights_layout.weights_orientation(hidden, intermediate,
                                                                       weights_transposed=options["transposed"])
        assert tuple(orientation) == expected, case


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_reference_and_grouped_path(kernel, interpret, to_jax, case, random_picks):
    tokens, hidden, intermediate, experts, top_k, options, gate = CASES[case]
    layer = _layer(random_picks, tokens, hidden, intermediate, experts, top_k, **options)
    gate = dict(weights_transposed=options["transposed"], **gate)
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate))
    grouped = interpret(lambda: kernel.experts_layer(*map(to_jax, layer), **gate, fused=False))
    assert not torch.isnan(fused).any()
    assert _relative_error(fused, expected) <= 1e-5
    assert _relative_error(fused, grouped.double()) <= 1e-5
    if case == "gpt-oss":
        _, index, _, gate_up, _, gate_up_bias, _ = layer
        pre = layer[0][0] @ gate_up[index[0, 0]] + gate_up_bias[index[0, 0]]
        assert pre.abs().max() > gate["limit"], "inputs must reach the clamp"


# Tiles forced small, so that every part of the schedule runs at affordable sizes.
TILED_CASES = {
    # I in two tiles: gate and up come as separate blocks; rows gathered at the first tile, scattered at the last.
    "i-tiles-plain": (20, 64, 256, 8, 2, dict(transposed=False, bias=True), dict(activation="silu"), (16, 128)),
    "i-tiles-transposed": (20, 64, 256, 8, 2, dict(transposed=True, bias=False), dict(activation="gelu_tanh"),
                           (16, 128)),
    # Interleaved in three I tiles (2 x 64 = 128-lane gate_up blocks), biases.
    "i-tiles-interleaved": (20, 64, 192, 8, 2, dict(transposed=True, bias=True, scale=0.6),
                            dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0), (16, 64)),
    # Experts with more rows than a chunk: several chunks per expert, some skipped for the others.
    "chunks-per-expert": (60, 64, 48, 4, 2, dict(transposed=False, bias=True), dict(activation="silu"), (8, 48)),
    # Several experts per step: 7 active experts in steps of 3 (the last step's two empty slots keep their blocks).
    "experts-per-step": (30, 64, 48, 7, 2, dict(transposed=False, bias=True), dict(activation="silu"), (8, 48, 3)),
    # GPT-OSS's layout, two experts per step, several chunks each.
    "experts-per-step-interleaved": (40, 64, 64, 5, 3, dict(transposed=True, bias=True, scale=0.6),
                                     dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0),
                                     (16, 64, 2)),
}


@pytest.mark.parametrize("case", list(TILED_CASES))
def test_fused_tiled_schedules_match_reference(kernel, interpret, to_jax, case, random_picks):
    tokens, hidden, intermediate, experts, top_k, options, gate, tiles = TILED_CASES[case]
    layer = _layer(random_picks, tokens, hidden, intermediate, experts, top_k, **options)
    gate = dict(weights_transposed=options["transposed"], **gate)
    config = kernel.fused.tiles.FusedConfig(*tiles)
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate, config=config))
    assert _relative_error(fused, expected) <= 1e-5


# v5p: the items split over its two TensorCores (grid (cores, steps per core, I tiles)), each core summing into an
# f32 partial of its own: an odd number of active experts (the second core's last step is empty), every expert
# active (the empty step's blocks clamp to the expert table), a single active expert, sentinels, I tiles.
MEGACORE_CASES = {
    "concatenated": (CASES["concatenated"], None),
    "odd-count-every-expert-active": ((7, 64, 40, 3, 2, dict(transposed=False, bias=True), dict(activation="silu")),
                                      None),
    "one-active-expert": ((5, 64, 40, 4, 1, dict(transposed=True, bias=True), dict(activation="gelu_tanh")), None),
    "sentinels": (CASES["sentinels"], None),
    "i-tiles-interleaved": (TILED_CASES["i-tiles-interleaved"][:7], TILED_CASES["i-tiles-interleaved"][7]),
    # Two experts per step on each core: 3 active experts, so the second core has one, its second slot none.
    "experts-per-step": ((7, 64, 40, 3, 2, dict(transposed=False, bias=True), dict(activation="silu")), (8, 40, 2)),
    # The cores share every expert (cores_per_expert 2): one I tile each, biases (the down bias added once).
    "shared-two-i-tiles": ((7, 64, 256, 3, 2, dict(transposed=False, bias=True), dict(activation="silu")),
                           (8, 128, 1, 2)),
    # A single active expert, five I tiles: three on the first core, two and an empty step on the second.
    "shared-one-active-expert-odd-tiles": ((5, 64, 640, 4, 1, dict(transposed=True, bias=True),
                                            dict(activation="gelu_tanh")), (8, 128, 1, 2)),
    # GPT-OSS's interleaved layout in three I tiles (two, then one and an empty step), several chunks per expert.
    "shared-interleaved-odd-tiles": ((20, 64, 192, 4, 2, dict(transposed=True, bias=True, scale=0.6),
                                      dict(activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0)),
                                     (8, 64, 1, 2)),
    # Sentinels and experts without picks, four I tiles (two per core).
    "shared-sentinels": ((64, 64, 512, 16, 4, dict(transposed=False, bias=True, sentinels=0.8),
                          dict(activation="silu")), (16, 128, 1, 2)),
}


@pytest.mark.parametrize("case", list(MEGACORE_CASES))
def test_megacore_split_matches_reference(kernel, interpret, to_jax, case, random_picks):
    (tokens, hidden, intermediate, experts, top_k, options, gate), tiles = MEGACORE_CASES[case]
    layer = list(_layer(random_picks, tokens, hidden, intermediate, experts, top_k, **options))
    if case == "one-active-expert":
        layer[1] = torch.full_like(layer[1], 2)
    active = np.unique(layer[1].numpy())
    active = active[active < experts]
    if case in ("odd-count-every-expert-active", "experts-per-step"):
        assert len(active) == experts == 3
    if case.startswith("shared-one-active"):
        layer[1] = torch.full_like(layer[1], 1)
    gate = dict(weights_transposed=options["transposed"], **gate)
    config = None if tiles is None else kernel.fused.tiles.FusedConfig(*tiles)
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    plan = kernel.fused.plan.make(problem, V5P, config)
    assert plan.cores == 2 and plan.cores_per_expert == (2 if case.startswith("shared") else 1)
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    # Two simulated cores: each its own scratch and partial output, the grid's parallel axis split between them.
    split = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate, config=config,
                                                   generation="v5p"), cores=2)
    assert not torch.isnan(split).any()
    assert _relative_error(split, expected) <= 1e-5


@pytest.mark.parametrize("generation", ["v6e", "v5p"])
def test_fewer_active_experts_than_slots(kernel, interpret, to_jax, generation, random_picks):
    """One active expert, four slots per step: the first step's empty slots fetch blocks they never use."""
    layer = list(_layer(random_picks, 9, 64, 48, 6, 2, transposed=True, bias=True))
    layer[1] = torch.full_like(layer[1], 4)
    gate = dict(activation="gelu_tanh", weights_transposed=True)
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    config = kernel.fused.tiles.FusedConfig(16, 48, 4)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate, config=config,
                                                   generation=generation))
    assert _relative_error(fused, expected) <= 1e-5


# The interleaved body's loop over slabs of its I tile (fused.tiles.MAX_SLAB_I, lowered here so that small I takes
# several trips): GPT-OSS's layout with the whole I in three slabs; the plain layout, whose down slabs are lane
# columns (whole 128-lane tiles), in two; two I tiles of two slabs each.
SLAB_CASES = {
    "whole-i-three-slabs": (CASES["gpt-oss"][:2] + (192,) + CASES["gpt-oss"][3:], None, 64),
    "plain-layout-two-slabs": ((9, 64, 256, 5, 2, dict(transposed=False, bias=True),
                                dict(activation="silu", interleaved=True)), None, 128),
    "i-tiles-two-slabs-each": ((20, 128, 256, 8, 2) + TILED_CASES["i-tiles-interleaved"][5:7], (16, 128), 64),
}


@pytest.mark.parametrize("case", list(SLAB_CASES))
def test_interleaved_body_loops_over_slabs_of_its_i_tile(kernel, interpret, to_jax, case, random_picks, monkeypatch):
    (tokens, hidden, intermediate, experts, top_k, options, gate), tiles, most = SLAB_CASES[case]
    monkeypatch.setattr(kernel.fused.tiles, "MAX_SLAB_I", most)
    layer = _layer(random_picks, tokens, hidden, intermediate, experts, top_k, **options)
    gate = dict(weights_transposed=options["transposed"], **gate)
    config = None if tiles is None else kernel.fused.tiles.FusedConfig(*tiles)
    problem, _ = kernel.problem.describe_experts(*map(to_jax, layer), **gate)
    plan = kernel.fused.plan.make(problem, resolve_target(), config)
    assert plan.tile_i // plan.slab_i >= 2, f"{case} must take several slabs per I tile"
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate, config=config))
    assert not torch.isnan(fused).any()
    assert _relative_error(fused, expected) <= 1e-5


def test_gpt_oss_whole_i_tiles_loop_over_slabs(kernel):
    """GPT-OSS's I = 2880 whole (as int8 and int4 take it on v5e and v6e): three slabs of 960; its tiles of 960 (bf16,
    fp8): one."""
    for weights_dtype in ("bfloat16", "int8", "uint8"):
        problem = kernel.problem.ExpertsProblem(64, 4, 2880, 2880, 4, "bfloat16", weights_dtype, "bfloat16", True,
                                        True, kernel.problem.Gate("clamped_swiglu", True, 1.702, 7.0))
        assert kernel.fused.tiles.slab_i(2880, problem) == kernel.fused.tiles.slab_i(960, problem) == 960


def test_tiled_cases_run_what_they_name(kernel, random_picks):
    tokens, hidden, intermediate, experts, top_k, options, _, (chunk, _) = TILED_CASES["chunks-per-expert"]
    _, index, weights, *_ = _layer(random_picks, tokens, hidden, intermediate, experts, top_k, **options)
    rows = np.bincount(index.numpy().ravel(), minlength=experts)
    assert rows.max() > 2 * chunk and rows.min() < rows.max() - chunk, "experts must span different chunk counts"
    for case in ("i-tiles-plain", "i-tiles-transposed", "i-tiles-interleaved"):
        assert TILED_CASES[case][7][1] < TILED_CASES[case][2], f"{case} must tile I"
    for case in ("experts-per-step", "experts-per-step-interleaved"):
        tokens, hidden, intermediate, experts, top_k, options, _, (chunk, _, slots) = TILED_CASES[case]
        _, index, *_ = _layer(random_picks, tokens, hidden, intermediate, experts, top_k, **options)
        rows = np.bincount(index.numpy().ravel(), minlength=experts)
        assert (rows > 0).sum() % slots and rows.max() > chunk, f"{case}: a partial last step, several chunks"


@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_bf16_activations_with_either_routing_weights(kernel, interpret, to_jax, weights_dtype, random_picks):
    layer = _layer(random_picks, 33, 64, 48, 8, 3, transposed=False, bias=True, dtype=torch.bfloat16,
                   weights_dtype=weights_dtype)
    gate = dict(activation="silu", weights_transposed=False)
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate))
    # bf16 weights and activations (8-bit mantissa), rounded once more at the output.
    assert _relative_error(fused, expected) < 2e-2


@pytest.mark.parametrize("tiles", [None, (16, 128), (16, 256, 3)])
def test_only_sentinel_picks_give_zeros(kernel, interpret, to_jax, tiles, random_picks):
    layer = _layer(random_picks, 6, 64, 256, 8, 2, transposed=False, bias=True, sentinels=1.0)
    assert bool((layer[1] == 8).all())
    config = None if tiles is None else kernel.fused.tiles.FusedConfig(*tiles)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), activation="silu",
                                                                 weights_transposed=False, config=config))
    assert torch.equal(fused, torch.zeros_like(fused))


def test_expert_plan_lists_active_experts_only(kernel):
    # 3 tokens, top-2, 4 experts; sentinel id 4 (other ranks). Expert 2: two picks; expert 1: none;
    # token 1 picks expert 0 twice.
    index = jnp.asarray([[2, 4], [0, 0], [2, 3]], jnp.int32)
    plan = kernel.common.routing.expert_plan(index, 4)
    assert int(plan.count[0]) == 3
    assert np.asarray(plan.expert).tolist() == [0, 2, 3, 3]  # active experts, then the last repeated
    assert np.asarray(plan.rows).tolist() == [2, 2, 1, 0]  # picks (at least the rows), 0 past the count
    empty = kernel.common.routing.expert_plan(jnp.full((3, 2), 4, jnp.int32), 4)
    assert int(empty.count[0]) == 1 and int(empty.rows[0]) == 0  # one empty item: the grid is never empty


def test_repeated_picks_of_one_expert_add_up(kernel, interpret, to_jax, random_picks):
    layer = list(_layer(random_picks, 5, 64, 48, 4, 2, transposed=False, bias=True))
    layer[1][:, 1] = layer[1][:, 0]  # every token picks its first expert twice
    gate = dict(activation="silu", weights_transposed=False)
    expected = kernel.reference.gated_experts_reference(*layer, **gate)
    fused = interpret(lambda: kernel.fused.kernel.fused_experts(*map(to_jax, layer), **gate))
    assert _relative_error(fused, expected) <= 1e-5


def _pallas_calls(fn, *args) -> list[str]:
    """The names of the Pallas kernels `fn(*args)` runs, in order, read off its traced program (nested ones too)."""
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(str(eqn.params["name"]))
            for param in eqn.params.values():
                for value in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(value, "jaxpr", value)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


def test_experts_layer_takes_the_fused_kernel_for_decode_only(kernel):
    """experts_layer follows the rule (`fused_path_config`): the fused kernel up to FUSED_MAX_TOKENS tokens, the
    grouped matmuls past it."""
    hidden, intermediate, experts, top_k = 64, 48, 4, 2

    def kernels_run(tokens):
        avals = (jax.ShapeDtypeStruct((tokens, hidden), jnp.float32), jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((tokens, top_k), jnp.float32),
                 jax.ShapeDtypeStruct((experts, 2 * intermediate, hidden), jnp.float32),
                 jax.ShapeDtypeStruct((experts, hidden, intermediate), jnp.float32))
        layer = functools.partial(kernel.experts_layer, activation="silu", weights_transposed=False)
        return _pallas_calls(layer, *avals)

    assert kernels_run(kernel.plan.FUSED_MAX_TOKENS) == ["fused_experts"]
    grouped = kernels_run(kernel.plan.FUSED_MAX_TOKENS + 1)
    assert "fused_experts" not in grouped and grouped.count("ragged_dot") == 2


def test_both_paths_of_the_experts_layer_give_the_layer(kernel, interpret, to_jax, random_picks):
    layer = _layer(random_picks, 8, 64, 48, 4, 2, transposed=False, bias=False)
    expected = kernel.reference.gated_experts_reference(*layer, activation="silu", weights_transposed=False)
    for fused in (True, False):
        out = interpret(lambda: kernel.experts_layer(*map(to_jax, layer), activation="silu", weights_transposed=False,
                                                     fused=fused))
        assert _relative_error(out, expected) <= 1e-5


# (tokens, top_k, intermediate, cores, cores_per_expert) of GPT-OSS's layout on v5p.
SPLITS = {
    # One pick of GPT-OSS's 2880-wide experts: both cores share the one active expert, in I tiles of 320.
    "one pick, experts shared": (1, 1, 2880, 2, 2),
    "one token of four picks, experts shared": (1, 4, 2880, 2, 2),
    # Eight picks of four experts (3.6 expected active): the experts split as evenly as their I tiles would.
    "eight picks, experts apart": (8, 1, 2880, 2, 1),
    # I = 64 is a single 128-lane block of interleaved gate_up columns, no I tile per core: one pick takes one
    # core, where the second would have no expert and still fetch a step's weights.
    "one pick, no I tiles to share": (1, 1, 64, 1, 1),
}


@pytest.mark.parametrize("case", list(SPLITS))
def test_how_v5p_cores_split_few_picks(kernel, case):
    tokens, top_k, intermediate, cores, cores_per_expert = SPLITS[case]
    problem = kernel.problem.ExpertsProblem(tokens, top_k, 2880, intermediate, 4, "bfloat16", "bfloat16", "float32",
                                    True, True, kernel.problem.Gate("clamped_swiglu", True, 1.702, 7.0))
    plan = kernel.fused.plan.make(problem, V5P)
    assert (plan.cores, plan.cores_per_expert) == (cores, cores_per_expert)
    if cores_per_expert > 1:
        assert plan.i_tiles_per_core * cores >= plan.i_tiles > (plan.i_tiles_per_core - 1) * cores
    on_v6e = kernel.fused.plan.make(problem, V6E)
    assert (on_v6e.cores, on_v6e.cores_per_expert) == (1, 1)
