"""Shapes `tpu-kernels check` compiles ahead of time for each TPU generation, at the models of `MODELS` (the one
list of their experts layers' sizes).

- The grouped matmul (`gmm.kernel.grouped_matmul`) on one projection of one MoE
  layer: rows are token-expert picks (tokens x top-k), 512 for a decode
  batch; transformers' weight layout is `[E, out, in]` (`transpose_rhs=True`);
  rows past the groups left unwritten, as an experts layer runs it. A
  prefill chunk's 16384 rows are compiled inside Qwen3-30B-A3B's layer at
  T=2048 below (the same two calls, at the same tiles). The first
  projection with the gate in its epilogue (`gmm.plan.gated_plan`) at those
  16384 rows: all 2I columns as one block (Gemma 4's I, off the 128
  lanes, split in VMEM), and Qwen3's in halves of 256 columns per N tile.
- The whole experts layer (`layer.experts_layer`: the routing in XLA and the
  kernels), which takes the fused kernel at decode sizes (T <= 256) and the
  grouped matmuls above, the first copying its rows from the tokens where it
  can (`gmm.plan.gathered_plan`): Qwen3-30B-A3B on one chip (EP1) and on
  one rank of eight (EP8), Gemma-4-26B-A4B, GPT-OSS-20B (transposed
  interleaved weights with biases, clamped SwiGLU) on one chip and on one
  rank of eight, and the
  one pick such a rank receives under EP dispatch, whose expert v5p's two
  cores share (`FusedConfig.cores_per_expert`: nine I tiles of 320, five and four).
  GPT-OSS at T=1 takes 16-row chunks, whose relayouts need the most of
  Mosaic's own VMEM (_hardware.MOSAIC_SCRATCH_BYTES).
- Training (the backward, `backward.py`) at T = 8192 tokens per rank, top-8
  (65536 picks), Qwen3-30B-A3B and Gemma-4-26B-A4B with all 128 experts on
  the rank: each projection's d_lhs grouped matmul (the forward kernel with
  the weights read the other way) and its weights' gradient (`tgmm`, in
  transformers' `[E, out, in]` layout). The whole layer's backward (these
  kernels and XLA's gather, scatter and gate around them) compiles too, but
  takes ~80 s per generation and shape, mostly XLA's: not part of the check.
- The same with quantized weights (`common/quant.py`): int8 with per-output-channel
  scales, fp8 (e4m3) with 128 x 128 block scales and int4 (packed two per
  byte) with per-output-channel scales, for the layers of Qwen3-30B-A3B (EP8
  decode: fused; EP1 prefill: grouped) and GPT-OSS-20B at EP8 decode (H and I
  off the fp8 scale blocks: partial ones) and at one token on one
  chip (16-row chunks of whole I tiles, where unpacking
  int4 needs the most VMEM of Mosaic's own); int4 also Gemma 4's
  down projection as a grouped matmul at decode rows (`[E, H, I]` with I
  off the lanes: XLA stores it swapped, so int4 packs I and the kernel
  reads the swapped view). int4 on every generation but TPU7x, which
  refuses it (`common.quant.NOT_SERVED`). On TPU7x the fused fp8 layers (Qwen3's,
  and GPT-OSS's with its interleaved gate/up) multiply fp8 activations on the
  fp8 MXU (`fused.plan.FusedPlan.fp8_matmul`).
"""

import functools

import jax
import jax.numpy as jnp

from ._hardware import resolve_target
from .common.quant import INT4, NOT_SERVED, expected_scales_shape, int4_packed_axis
from .gmm import kernel as gmm_kernel, plan as gmm_plan, tiles as gmm_tiles
from .gmm.kernel import grouped_matmul
from .gmm.plan import gated_plan
from .layer import experts_layer
from .plan import fused_path_config
from .problem import ExpertsProblem, Gate, MatmulProblem
from .tgmm.kernel import transposed_grouped_matmul

# The one list of the models' experts layers, by tag: experts, hidden size, each expert's intermediate size, top-k,
# the gate (`Gate`'s fields), whether the weights are stored transposed (`[E, in, out]`) and carry biases. Plain
# literals: the lab reads them from this file without importing the kernel (benchmarks/studies/model_shapes.py).
MODELS = {
    "qwen3-30b-a3b": {"experts": 128, "hidden": 2048, "intermediate": 768, "top_k": 8,
                      "gate": {"activation": "silu"}, "weights_transposed": False, "biases": False},
    "gemma-4-26b-a4b": {"experts": 128, "hidden": 2816, "intermediate": 704, "top_k": 8,
                        "gate": {"activation": "gelu_tanh"}, "weights_transposed": False, "biases": False},
    "gpt-oss-20b": {"experts": 32, "hidden": 2880, "intermediate": 2880, "top_k": 4,
                    "gate": {"activation": "clamped_swiglu", "interleaved": True, "alpha": 1.702, "limit": 7.0},
                    "weights_transposed": True, "biases": True},
}
# The grouped matmul alone: the models it runs, at the rows of a decode batch.
GROUPED = ("qwen3-30b-a3b", "gemma-4-26b-a4b")
GROUPED_ROWS = (512,)


def _layer(model, ranks, token_counts, top_k=None):
    """(experts on one of `ranks` expert-parallel ranks, hidden, intermediate, top-k, layout, gate, token counts)."""
    shape = MODELS[model]
    return (shape["experts"] // ranks, shape["hidden"], shape["intermediate"], top_k or shape["top_k"],
            dict(weights_transposed=shape["weights_transposed"]), dict(shape["gate"]), token_counts)


LAYERS = {
    "qwen3-30b-a3b EP1": _layer("qwen3-30b-a3b", 1, (1, 256, 2048)),
    "qwen3-30b-a3b EP8": _layer("qwen3-30b-a3b", 8, (256,)),
    "gemma-4-26b-a4b": _layer("gemma-4-26b-a4b", 1, (256,)),
    "gpt-oss-20b EP1": _layer("gpt-oss-20b", 1, (1, 256, 2048)),
    "gpt-oss-20b EP8": _layer("gpt-oss-20b", 8, (64,)),
    # A rank's one received pick under EP dispatch (rows of top-1): on v5p both cores share its expert.
    "gpt-oss-20b EP8 dispatch": _layer("gpt-oss-20b", 8, (1,), top_k=1),
}


def _grouped_targets(target, dtype):
    targets = []
    for model in GROUPED:
        experts, hidden, intermediate = (MODELS[model][key] for key in ("experts", "hidden", "intermediate"))
        for rows in GROUPED_ROWS:
            for projection, k, n in (("gate_up", hidden, 2 * intermediate), ("down", intermediate, hidden)):
                fn = functools.partial(grouped_matmul, transpose_rhs=True, zero_rows_past_groups=False,
                                       generation=target)
                avals = (
                    jax.ShapeDtypeStruct((rows, k), dtype),
                    jax.ShapeDtypeStruct((experts, n, k), dtype),
                    jax.ShapeDtypeStruct((experts,), jnp.int32),
                )
                targets.append((f"{model} {projection} M={rows} K={k} N={n} E={experts} bf16", fn, avals))
    for model, tile_n in GATED.items():
        experts, hidden, intermediate = (MODELS[model][key] for key in ("experts", "hidden", "intermediate"))
        targets.append(_gated_target(model, experts, hidden, intermediate, tile_n, target, dtype))
    return targets


# The gated gate_up's N tile (over 2I): whole (one block, split after the matmul), or halves per N tile.
GATED = {"gemma-4-26b-a4b": 2 * MODELS["gemma-4-26b-a4b"]["intermediate"], "qwen3-30b-a3b": 512}
GATED_ROWS = 16384


def _gated_target(model, experts, hidden, intermediate, tile_n, target, dtype):
    problem = MatmulProblem(GATED_ROWS, hidden, 2 * intermediate, experts, jnp.dtype(dtype).name,
                            jnp.dtype(dtype).name, transpose_rhs=True, zero_rows_past_groups=False)
    heuristic = gmm_tiles.select(problem, target)
    ungated = gmm_plan.make(problem, target, heuristic._replace(tile_n=tile_n))
    plan = gated_plan(ungated, Gate("silu"), target)
    if plan is None:
        raise ValueError(f"{model}: no gated plan at tile_n={tile_n} on {target.name}")
    avals = (jax.ShapeDtypeStruct((GATED_ROWS, hidden), dtype),
             jax.ShapeDtypeStruct((experts, 2 * intermediate, hidden), dtype),
             jax.ShapeDtypeStruct((experts,), jnp.int32))
    mode = "one block" if plan.tile_n == intermediate else f"halves of {plan.tile_n}"
    return (f"{model} gated gate_up M={GATED_ROWS} K={hidden} I={intermediate} E={experts} ({mode}) bf16",
            lambda x, w, sizes: gmm_kernel.call(x, w, sizes, plan), avals)


def _weight_shapes(experts, hidden, intermediate, transposed):
    """gate_up_proj's and down_proj's shapes in the layer's layout."""
    gate_up = (experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)
    down = (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)
    return gate_up, down


def _layer_avals(tokens, hidden, top_k, dtype, gate_up, down, weights_dtype, *rest):
    """Avals of experts_layer's arrays: hidden states, picks, routing weights, the two weights, then `rest`."""
    return (
        jax.ShapeDtypeStruct((tokens, hidden), dtype),
        jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
        jax.ShapeDtypeStruct((tokens, top_k), dtype),
        jax.ShapeDtypeStruct(gate_up, weights_dtype),
        jax.ShapeDtypeStruct(down, weights_dtype),
        *rest,
    )


def _has_biases(layer):
    """Whether the model of the layer named `layer` ("<model> EP8 ...") carries biases."""
    return MODELS[next(model for model in MODELS if layer.startswith(model))]["biases"]


def _path(problem, target):
    """Which kernel the layer runs for `problem` (`plan.fused_path_config`), for the target's label."""
    return "grouped" if fused_path_config(problem, target) is None else "fused"

def _layer_targets(target, dtype):
    targets = []
    for model, (experts, hidden, intermediate, top_k, layout, gate, token_counts) in LAYERS.items():
        transposed = layout["weights_transposed"]
        gate_up, down = _weight_shapes(experts, hidden, intermediate, transposed)
        biases = ((experts, 2 * intermediate), (experts, hidden)) if _has_biases(model) else ()
        for tokens in token_counts:
            fn = functools.partial(experts_layer, **layout, **gate, generation=target)
            avals = _layer_avals(tokens, hidden, top_k, dtype, gate_up, down, dtype,
                                 *(jax.ShapeDtypeStruct(bias, dtype) for bias in biases))
            path = _path(ExpertsProblem(tokens, top_k, hidden, intermediate, experts, jnp.dtype(dtype).name,
                                        jnp.dtype(dtype).name, jnp.dtype(dtype).name, transposed, bool(biases),
                                        Gate(**gate)), target)
            targets.append((f"{model} experts layer T={tokens} top-{top_k} ({path}) bf16", fn, avals))
    return targets


TRAINING = {name: LAYERS[name][:4] for name in ("qwen3-30b-a3b EP1", "gemma-4-26b-a4b")}
TRAINING_TOKENS = 8192


def _backward_targets(target, dtype):
    targets = []
    for model, (experts, hidden, intermediate, top_k) in TRAINING.items():
        rows = TRAINING_TOKENS * top_k
        sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)
        for projection, k, n in (("gate_up", hidden, 2 * intermediate), ("down", intermediate, hidden)):
            # The forward ran lhs[rows, k] x weights[E, n, k] (transpose_rhs=True).
            d_lhs_problem = MatmulProblem(rows, n, k, experts, jnp.dtype(dtype).name, jnp.dtype(dtype).name,
                                          transpose_rhs=False)
            d_lhs = functools.partial(grouped_matmul, transpose_rhs=False,
                                      config=gmm_tiles.select_d_lhs(d_lhs_problem, target))
            targets.append((
                f"{model} {projection} d_lhs M={rows} K={n} N={k} E={experts} bf16", d_lhs,
                (jax.ShapeDtypeStruct((rows, n), dtype), jax.ShapeDtypeStruct((experts, n, k), dtype), sizes),
            ))
            d_rhs = functools.partial(transposed_grouped_matmul, generation=target)
            targets.append((
                f"{model} {projection} tgmm M={rows} -> [E={experts}, {n}, {k}] bf16", d_rhs,
                (jax.ShapeDtypeStruct((rows, n), dtype), jax.ShapeDtypeStruct((rows, k), dtype), sizes),
            ))
    return targets


QUANTIZED_LAYERS = {"qwen3-30b-a3b EP8": (256,), "qwen3-30b-a3b EP1": (2048,), "gpt-oss-20b EP8": (64,),
                    "gpt-oss-20b EP1": (1,)}
# Grouped matmuls compiled for one scheme only, at decode rows: (model, projection).
SCHEME_PROJECTIONS = {"int4": (("gemma-4-26b-a4b", "down"),)}
SCHEMES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.uint8}


def _scales(scheme, weight_shape, out_axis):
    return jax.ShapeDtypeStruct(expected_scales_shape(scheme, weight_shape, out_axis), jnp.float32)


def _stored(scheme, weight_shape):
    """The array shape of a `[G, D1, D2]` weight in `scheme`: int4 packed two per byte (`int4_packed_axis`)."""
    if scheme != INT4:
        return weight_shape
    axis = int4_packed_axis(weight_shape)
    return tuple(d // 2 if i == axis else d for i, d in enumerate(weight_shape))


def _quantized_targets(target, dtype):
    targets = []
    for scheme, weights_dtype in SCHEMES.items():
        if (scheme, target.name) in NOT_SERVED:
            continue
        for model, projection in SCHEME_PROJECTIONS.get(scheme, ()):
            experts, hidden, intermediate = (MODELS[model][key] for key in ("experts", "hidden", "intermediate"))
            k, n = (hidden, 2 * intermediate) if projection == "gate_up" else (intermediate, hidden)
            rhs = (experts, n, k)
            fn = functools.partial(grouped_matmul, transpose_rhs=True, zero_rows_past_groups=False,
                                   generation=target)
            avals = (jax.ShapeDtypeStruct((512, k), dtype), jax.ShapeDtypeStruct(_stored(scheme, rhs), weights_dtype),
                     jax.ShapeDtypeStruct((experts,), jnp.int32), _scales(scheme, rhs, 1))
            targets.append((f"{model} {projection} M=512 K={k} N={n} E={experts} {scheme}", fn, avals))
        for model, token_counts in QUANTIZED_LAYERS.items():
            experts, hidden, intermediate, top_k, layout, gate, _ = LAYERS[model]
            transposed = layout["weights_transposed"]
            gate_up, down = _weight_shapes(experts, hidden, intermediate, transposed)
            out_axis = 2 if transposed else 1
            has_bias = _has_biases(model)
            biases = (jax.ShapeDtypeStruct((experts, 2 * intermediate), dtype),
                      jax.ShapeDtypeStruct((experts, hidden), dtype)) if has_bias else (None, None)
            for tokens in token_counts:
                # Positional: the optional biases may be None; avals are the array arguments only.
                def fn(hidden_states, index, weights, gate_up_proj, down_proj, *rest, _layout=layout, _gate=gate,
                       _bias=has_bias):
                    gate_up_bias, down_bias, gate_up_scales, down_scales = rest if _bias else (None, None, *rest)
                    return experts_layer(hidden_states, index, weights, gate_up_proj, down_proj, gate_up_bias,
                                         down_bias, gate_up_scales, down_scales, **_layout, **_gate,
                                         generation=target)

                avals = _layer_avals(tokens, hidden, top_k, dtype, _stored(scheme, gate_up), _stored(scheme, down),
                                     weights_dtype,
                                     *(bias for bias in biases if bias is not None),
                                     _scales(scheme, gate_up, out_axis), _scales(scheme, down, out_axis))
                path = _path(ExpertsProblem(tokens, top_k, hidden, intermediate, experts, jnp.dtype(dtype).name,
                                            jnp.dtype(weights_dtype).name, jnp.dtype(dtype).name, transposed,
                                            has_bias, Gate(**gate)), target)
                targets.append((f"{model} experts layer T={tokens} top-{top_k} ({path}) {scheme}", fn, avals))
    return targets


def compile_targets(generation):
    dtype, target = jnp.bfloat16, resolve_target(generation)
    return (_grouped_targets(target, dtype) + _layer_targets(target, dtype)
            + _backward_targets(target, dtype) + _quantized_targets(target, dtype))
