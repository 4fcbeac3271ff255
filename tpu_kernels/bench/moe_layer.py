"""The MoE experts layer as users run it: ours vs the best-tuned rivals vs the roofline, modelled for v5e and v6e.

No TPU is needed. For every shape (model, expert-parallel rank, tokens) and
generation this benchmark models one whole experts layer, as kernelize runs
it and as a user would build it from each rival:

- ours: the kernel repo's own JAX entry behind its fused torch op
  (`LAYER_ENTRY`, today `moe.experts_layer`), loaded from the built kernel
  (`tpu_kernels.distribution.builder.build_kernel_repo` + `kernels.get_local_kernel`), at
  the arguments transformers hands `experts_forward`: T tokens x top-k picks
  without expert parallelism; under EP router masking all T x top-k picks,
  other ranks' picks as id == local expert count (weight 0); under EP
  dispatch only the rows sent to the rank (top-1, weight 1, local ids);
- megablox `gmm` and tokamax's Pallas TPU `ragged_dot` kernel, each at the
  best config of its own config space for this shape and generation (a
  searched subset, see `candidate_tilings`), and XLA's `lax.ragged_dot`, each
  inside the same user-written layer: sort the picks by expert (other
  ranks' picks last), gather the rows, pad them to the kernel's row tile,
  grouped matmul, bias and gate, grouped matmul, then each token gathers its
  picks' rows (rows past the groups masked), weights and sums them, the glue
  ours uses; every layer reads each projection's weights in the order XLA
  stores them (`stored_order`);
- labelled extra rows (never headlines): megablox at its default tiling
  (128, 128, 128), which is also what tokamax picks for every shape here.

Each layer is compiled ahead of time for the generation (libtpu
compile-only topology) and analysed by `tpu_kernels.perf.xla_program`: every XLA
op's HBM / VMEM traffic from the optimized HLO (where XLA placed each
buffer), XLA's ragged-dot loops replayed (`tpu_kernels.perf.xla_ragged_dot`), and
each Pallas kernel by `tpu_kernels.perf`'s grid replay, with the kernel
operands XLA placed in VMEM moving no HBM bytes. Ours compiles with its real
kernel bodies (that Mosaic accepts them is part of the result); the rivals'
layers compile with empty kernel bodies (`lower_program(kernel_bodies=False)`:
the XLA program and placements are the same, Mosaic's VMEM check of their
bodies is not made; their kernels' time is the replay's either way).

The headline is the calibrated pipelined figure (`pipelined_time_s`: each
grid step max(its compute, its neighbours' copies) + the fitted per-step cost
of the generation, `perf.grid_step_s`), the figure `tpu-kernels
calibrate` holds against real chips. Every time carries the calibrated error
band of its terms (`calibration_bands`: Pallas kernels at the Pallas
ragged-dot error, XLA ragged-dot loops at theirs, other XLA ops uncalibrated).
v6e has no measurements: its constants and bands are v5e's. The roofline of a
shape is max(minimum bytes / peak bandwidth, useful FLOPs / bf16 peak),
minimum bytes = the rows in, the routing, each active expert's weights (and
biases) once, the rows out.

Routing: per model and token count, expert popularity ~ Dirichlet(8)
(seeded), each token picks top-k distinct experts by Gumbel-top-k over log
popularity; an EP setting models the busiest rank (it sets the layer's
latency).

Compiles dominate the run time: a compile is cached on disk as the text it
leaves (HLO, codegen, cost, memory: `calibration.CompiledText`) by the
lowered module's text and the library versions only, so a change of the
model re-analyses and never recompiles; a grid replay by the traced jaxpr,
its concrete arguments and perf.py's source.

Output: `--out` (benchmarks/results/moe_layer.json, tracked) holds one line
per (shape, generation) and per (shape, generation, variant), the targets and
the Hugging Face 257 us case, with sorted keys and no run facts; the raw rows
(every term, placement, searched config) and the run's own facts (seconds,
cache hits, load) go to benchmarks/results/raw/ (untracked).

Usage:
    tpu-kernels bench moe_layer [--out benchmarks/results/moe_layer.json]
        [--repo kernel_repos/ragged-dot-tpu] [--settings LABEL ...] [--tokens T ...] [--jobs 2] [--no-cache]
        [--retarget]
    tpu-kernels bench kernel_repos/ragged-dot-tpu [...]        (the same, --repo from the path)
    JAX_PLATFORMS=cpu python -m tpu_kernels.bench.moe_layer [...]
Paths are relative to the current directory: run from the project's checkout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pickle
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels import perf
from tpu_kernels.bench import calibration_bands, kernel_repo, require_kernel_repo, result_path
from tpu_kernels.perf import calibration, grid_step_s, tokamax_kernels, xla_program
from tpu_kernels.runtime.hardware import default_layout_swaps_minor_dims, round_up, tpu_generation

# Relative to the current directory (tpu_kernels.bench).
DEFAULT_REPO = kernel_repo("ragged-dot-tpu")
DEFAULT_OUT = result_path("moe_layer.json")
# Raw rows and the run's own facts (untracked: .gitignore).
RAW_DIR = result_path("raw")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tpu-kernels" / "moe_layer"
# The JAX function behind the built kernel's fused experts op, as "module.function" of the built package.
LAYER_ENTRY = "moe.experts_layer"
GENERATIONS = ("v5e", "v6e")
DTYPE = jnp.bfloat16
SEED = 0
POPULARITY_CONCENTRATION = 8.0
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS = (2048, 8192)
# The headline: the pipelined figure at the generation's calibrated grid-step cost and peak HBM bandwidth.
HEADLINE = "pipelined"
# Also reported per variant: the same at 85 % of peak HBM bandwidth, and the figure in which each kernel's
# MXU work fully overlaps its copies (`time_s`, the headline before calibration).
SENSITIVITY = ("pipelined_hbm85", "overlap")
TOKAMAX_MIN_ROWS = 128  # tokamax's op refuses lhs or rhs dimensions below 128
ROW_TILES = (128, 256, 512)
# Targets of issue 13, checked in the JSON's "targets".
ANCHOR = ("qwen3-30b-a3b EP8 router-masking", 256, "v6e")
# The same rank under Qwen3's own default in transformers (issue 24 asks for both modes).
ANCHOR_DISPATCH = ("qwen3-30b-a3b EP8 dispatch", 256, "v6e")
ANCHOR_TARGET_US = 100.0
DECODE_MAX_OVER_ROOFLINE = 1.08
PREFILL_MIN_MXU_PCT = 85.0


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    activation: str  # "silu" | "gelu_tanh" | "clamped_swiglu"
    # transformers' layouts: gate_up [E, 2I, H], down [E, H, I]; transposed: [E, H, 2I], [E, I, H].
    weights_transposed: bool = False
    interleaved: bool = False  # gate / up in even / odd columns (GPT-OSS)
    bias: bool = False
    alpha: float = 1.0
    limit: float = float("inf")


MODELS = {
    model.name: model
    for model in (
        Model("qwen3-30b-a3b", hidden=2048, intermediate=768, experts=128, top_k=8, activation="silu"),
        Model("gemma-4-26b-a4b", hidden=2816, intermediate=704, experts=128, top_k=8, activation="gelu_tanh"),
        Model("gpt-oss-20b", hidden=2880, intermediate=2880, experts=32, top_k=4, activation="clamped_swiglu",
              weights_transposed=True, interleaved=True, bias=True, alpha=1.702, limit=7.0),
        Model("deepseek-v3", hidden=7168, intermediate=2048, experts=256, top_k=8, activation="silu"),
    )
}


@dataclasses.dataclass(frozen=True)
class Setting:
    model: Model
    ep: int
    mode: str  # "local" (no expert parallelism) | "router-masking" | "dispatch"

    @property
    def label(self) -> str:
        return self.model.name if self.ep == 1 else f"{self.model.name} EP{self.ep} {self.mode}"

    @property
    def local_experts(self) -> int:
        return self.model.experts // self.ep


# Each model's EP mode is its transformers default (`base_model_ep_plan`: dispatch for Qwen3-MoE, GPT-OSS and
# DeepSeek-V3, router masking for Gemma 4); Qwen3's EP8 rank also runs router masking, the issue's anchor.
SETTINGS = (
    Setting(MODELS["qwen3-30b-a3b"], 1, "local"),
    Setting(MODELS["qwen3-30b-a3b"], 8, "router-masking"),
    Setting(MODELS["qwen3-30b-a3b"], 8, "dispatch"),
    Setting(MODELS["gemma-4-26b-a4b"], 1, "local"),
    Setting(MODELS["gemma-4-26b-a4b"], 8, "router-masking"),
    Setting(MODELS["gpt-oss-20b"], 1, "local"),
    Setting(MODELS["gpt-oss-20b"], 8, "dispatch"),
    Setting(MODELS["deepseek-v3"], 32, "dispatch"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One experts-layer call on one rank: the routing transformers hands `experts_forward`."""

    setting: Setting
    tokens: int
    top_k_index: np.ndarray  # [rows, k] int32, local ids; other ranks' picks = local expert count

    @property
    def model(self) -> Model:
        return self.setting.model

    @property
    def rows(self) -> int:
        return self.top_k_index.shape[0]

    @property
    def k(self) -> int:
        return self.top_k_index.shape[1]

    @property
    def picks(self) -> int:
        return self.rows * self.k

    @property
    def group_sizes(self) -> np.ndarray:
        local = self.setting.local_experts
        return np.bincount(self.top_k_index.ravel(), minlength=local + 1)[:local].astype(np.int32)

    @property
    def live_picks(self) -> int:
        return int(self.group_sizes.sum())

    @property
    def active_experts(self) -> int:
        return int(np.count_nonzero(self.group_sizes))

    @property
    def phase(self) -> str:
        return "decode" if self.tokens in DECODE_TOKENS else "prefill"

    @property
    def label(self) -> str:
        return f"{self.setting.label} T={self.tokens}"

    def weight_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        model, experts = self.model, self.setting.local_experts
        h, i = model.hidden, model.intermediate
        if model.weights_transposed:
            return (experts, h, 2 * i), (experts, i, h)
        return (experts, 2 * i, h), (experts, h, i)

    def avals(self, concrete_index: bool) -> list:
        """Layer arguments: hidden, top_k_index, top_k_weights, gate_up, down (, biases); abstract but the index."""
        gate_up, down = self.weight_shapes()
        index = self.top_k_index if concrete_index else jax.ShapeDtypeStruct(self.top_k_index.shape, jnp.int32)
        args = [
            jax.ShapeDtypeStruct((self.rows, self.model.hidden), DTYPE),
            index,
            jax.ShapeDtypeStruct(self.top_k_index.shape, DTYPE),
            jax.ShapeDtypeStruct(gate_up, DTYPE),
            jax.ShapeDtypeStruct(down, DTYPE),
        ]
        if self.model.bias:
            experts = self.setting.local_experts
            args += [jax.ShapeDtypeStruct((experts, 2 * self.model.intermediate), DTYPE),
                     jax.ShapeDtypeStruct((experts, self.model.hidden), DTYPE)]
        return args

    @property
    def min_bytes(self) -> int:
        model = self.model
        itemsize = jnp.dtype(DTYPE).itemsize
        h, i = model.hidden, model.intermediate
        per_expert = 3 * h * i + ((2 * i + h) if model.bias else 0)
        routing = self.picks * (4 + itemsize)
        return (2 * self.rows * h + self.active_experts * per_expert) * itemsize + routing

    @property
    def useful_flops(self) -> int:
        return 2 * self.live_picks * 3 * self.model.hidden * self.model.intermediate

    def roofline_s(self, generation: str) -> float:
        facts = tpu_generation(generation)
        return max(self.min_bytes / facts.hbm_bytes_per_s, self.useful_flops / facts.bf16_flops_per_s)


def global_picks(model: Model, tokens: int, seed: int) -> np.ndarray:
    """[tokens, top_k] expert ids: Dirichlet popularity, Gumbel-top-k per token (module docstring)."""
    rng = np.random.default_rng([seed, tokens, model.experts, model.top_k])
    popularity = rng.dirichlet(np.full(model.experts, POPULARITY_CONCENTRATION))
    scores = np.log(popularity) + rng.gumbel(size=(tokens, model.experts))
    return np.argpartition(-scores, model.top_k - 1, axis=1)[:, : model.top_k].astype(np.int32)


def make_case(setting: Setting, tokens: int, seed: int = SEED) -> Case:
    picks = global_picks(setting.model, tokens, seed)
    local = setting.local_experts
    if setting.ep == 1:
        return Case(setting, tokens, picks)
    rank_of = picks // local
    rank = int(np.argmax(np.bincount(rank_of.ravel(), minlength=setting.ep)))
    on_rank = rank_of == rank
    if setting.mode == "router-masking":
        return Case(setting, tokens, np.where(on_rank, picks - rank * local, local).astype(np.int32))
    # Dispatch: the rank receives its picks from every source rank (transformers' all-to-all), in source order.
    received = picks[on_rank] - rank * local
    return Case(setting, tokens, received.reshape(-1, 1).astype(np.int32))


def make_cases(settings, tokens_list) -> list[Case]:
    return [make_case(setting, tokens) for setting in settings for tokens in tokens_list]


# ----------------------------------------------------------------------------- the layers


@contextlib.contextmanager
def build_folder(cache_dir: Path | None):
    """Where the kernel repo is built and loaded from: a fixed folder under the cache, else a temporary one.

    A Mosaic kernel's lowered text embeds the source paths of the code that traced it (its location info),
    so ours is only found in the compile cache when it is built at the same path on every run.
    """
    if cache_dir is None:
        with tempfile.TemporaryDirectory() as folder:
            yield Path(folder)
    else:
        folder = Path(cache_dir) / "build"
        folder.mkdir(parents=True, exist_ok=True)
        yield folder


def load_kernel(repo: Path, build_dir: Path):
    import kernels

    from tpu_kernels.distribution.builder import build_kernel_repo

    return kernels.get_local_kernel(build_kernel_repo(repo, build_dir), backend="cpu")


def layer_entry(built):
    target = built
    for part in LAYER_ENTRY.split("."):
        target = getattr(target, part)
    return target


def ours_layer(built, model: Model, generation: str):
    return functools.partial(
        layer_entry(built),
        activation=model.activation,
        weights_transposed=model.weights_transposed,
        interleaved=model.interleaved,
        alpha=model.alpha,
        limit=model.limit,
        generation=generation,
    )


# One-byte expert weights (issue 14), ours only, decode shapes only: labelled extra variants, never headlines.
QUANTIZED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QUANTIZED_ANCHOR_TARGET_US = {"int8": 55.0}
QUANTIZED_MAX_BYTES_OVER_MIN = 1.05
# A rival config Mosaic refuses to compile inside the layer is replaced by the next best, at most this many times.
MAX_COMPILE_FALLBACKS = 4


def quantized_layer(built, model: Model, generation: str):
    """Ours with quantized weights: arguments as `Case.avals`, then the two weights' scales."""
    layer = ours_layer(built, model, generation)

    def run(hidden, top_k_index, top_k_weights, gate_up, down, *rest):
        biases, scales = (rest[:2], rest[2:]) if model.bias else ((None, None), rest)
        return layer(hidden, top_k_index, top_k_weights, gate_up, down, *biases, *scales)

    return run


def quantized_avals(built, case: "Case", scheme: str, concrete_index: bool) -> list:
    """`case.avals` with one-byte weights, then their scales in the shapes the kernel repo's quant.py expects."""
    args = case.avals(concrete_index)
    shapes = case.weight_shapes()
    args[3:5] = [jax.ShapeDtypeStruct(shape, QUANTIZED[scheme]) for shape in shapes]
    out_axis = 2 if case.model.weights_transposed else 1
    return args + [jax.ShapeDtypeStruct(built.quant.expected_scales_shape(scheme, shape, out_axis), jnp.float32)
                   for shape in shapes]


def quantized_min_bytes(built, case: "Case", scheme: str) -> int:
    """The layer's minimum bytes with one-byte weights: each active expert's weights and scales once."""
    model = case.model
    h, i = model.hidden, model.intermediate
    out_axis = 2 if model.weights_transposed else 1
    scales = sum(math.prod(built.quant.expected_scales_shape(scheme, shape, out_axis)[1:]) * 4
                 for shape in case.weight_shapes())
    itemsize = jnp.dtype(DTYPE).itemsize
    per_expert = 3 * h * i + scales + ((2 * i + h) * itemsize if model.bias else 0)
    return 2 * case.rows * h * itemsize + case.active_experts * per_expert + case.picks * (4 + itemsize)


def split(x: jax.Array, model: Model) -> tuple[jax.Array, jax.Array]:
    """The gate and up halves of a `[rows, 2I]` array: even / odd columns (interleaved) or first / second half."""
    if model.interleaved:
        return x[:, 0::2], x[:, 1::2]
    return tuple(jnp.split(x, 2, axis=-1))


def gate(gate_part: jax.Array, up: jax.Array, model: Model) -> jax.Array:
    """The gated intermediate from the f32 gate and up projections, as the model's experts compute it."""
    if model.activation == "clamped_swiglu":
        gate_part = jnp.minimum(gate_part, model.limit)
        up = jnp.clip(up, -model.limit, model.limit)
        return (up + 1.0) * gate_part * jax.nn.sigmoid(gate_part * model.alpha)
    if model.activation == "gelu_tanh":
        return jax.nn.gelu(gate_part, approximate=True) * up
    return jax.nn.silu(gate_part) * up


def stored_order(model: Model, projection: str) -> tuple[bool, bool]:
    """(swap, transpose_rhs): how a layer reads `projection`'s weights in the order XLA stores them.

    transformers' `[E, N, K]` (`[E, K, N]` when transposed) is read as given,
    or, where XLA's default TPU layout keeps the last two dims swapped
    (`default_layout_swaps_minor_dims`: Gemma 4's down_proj), as the swapped
    view: a bitcast instead of a relayout of all the weights per call. Ours
    does the same (`config.weights_orientation`).
    """
    h, i = model.hidden, model.intermediate
    out_in = {"gate_up": (2 * i, h), "down": (h, i)}[projection]
    given = out_in[::-1] if model.weights_transposed else out_in
    swap = default_layout_swaps_minor_dims(given)
    return swap, (not model.weights_transposed) != swap


def user_layer(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None, down_bias=None, *,
               model: Model, rival: "Rival", configs):
    """The experts layer a user builds around a rival's grouped matmul (module docstring)."""
    rows, k = top_k_index.shape
    experts = gate_up.shape[0]
    (swap_gate_up, gate_up_transposed), (swap_down, down_transposed) = (
        stored_order(model, "gate_up"), stored_order(model, "down"))
    gate_up = jnp.swapaxes(gate_up, 1, 2) if swap_gate_up else gate_up
    down = jnp.swapaxes(down, 1, 2) if swap_down else down
    expert_ids = top_k_index.reshape(-1)
    order = jnp.argsort(expert_ids, stable=True)  # other ranks' picks (id == experts) sort last
    sizes = jnp.zeros(experts + 1, jnp.int32).at[expert_ids].add(1)[:experts]
    picks = rows * k
    bias_rows = jnp.minimum(expert_ids[order], experts - 1)
    projected = rival.padded_matmul(hidden[order // k], gate_up, sizes, gate_up_transposed, configs[0])
    # The glue ours uses (moe.grouped_experts): split before casting, biases split too, so XLA fuses it.
    gate_part, up = (part.astype(jnp.float32) for part in split(projected, model))
    if gate_up_bias is not None:
        gate_bias, up_bias = split(gate_up_bias, model)
        gate_part = gate_part + gate_bias[bias_rows].astype(jnp.float32)
        up = up + up_bias[bias_rows].astype(jnp.float32)
    intermediate = gate(gate_part, up, model).astype(hidden.dtype)
    out = rival.padded_matmul(intermediate, down, sizes, down_transposed, configs[1])
    # Each token gathers its picks' rows one pick slot at a time, weights and sums them (as ours); rows past
    # the groups hold whatever the kernel left there: masked before weighting.
    position = jnp.zeros_like(order).at[order].set(jnp.arange(picks, dtype=order.dtype)).reshape(rows, k)
    live = position < sizes.sum()
    pick_weights = jnp.where(live, top_k_weights.astype(jnp.float32), 0.0)
    pick_experts = jnp.minimum(top_k_index, experts - 1)
    result = jnp.zeros((rows, hidden.shape[1]), jnp.float32)
    for slot in range(k):
        picked = jnp.where(live[:, slot, None], out[position[:, slot]].astype(jnp.float32), 0.0)
        if down_bias is not None:
            picked = picked + down_bias[pick_experts[:, slot]].astype(jnp.float32)
        result = result + pick_weights[:, slot, None] * picked
    return result.astype(hidden.dtype)


def megablox_matmul(lhs, rhs, sizes, transpose_rhs, tiling):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    return gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype, tiling=tuple(tiling), transpose_rhs=transpose_rhs)


def tokamax_matmul(lhs, rhs, sizes, transpose_rhs, tiling):
    from jax import lax
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu_kernel as tokamax_kernel

    # tiling: (tile_m, tile_k, tile_n) with 2 input buffers, or with the buffer count as a fourth value.
    buffers = tiling[3] if len(tiling) > 3 else 2
    return tokamax_kernel.gmm(
        lhs, rhs, sizes, precision=(lax.Precision.DEFAULT, lax.Precision.DEFAULT), out_dtype=lhs.dtype,
        tiling=tuple(tiling[:3]), input_buffer_count=buffers, transpose_rhs=transpose_rhs,
    )


def xla_matmul(lhs, rhs, sizes, transpose_rhs, config):
    from jax import lax

    del config
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2 if transpose_rhs else 1,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    return lax.ragged_dot_general(lhs, rhs, sizes, dims, preferred_element_type=lhs.dtype)


@dataclasses.dataclass(frozen=True)
class Rival:
    name: str
    matmul: object  # matmul(lhs, rhs, sizes, transpose_rhs, tiling) -> [rows, N]
    min_rows: int  # rows the kernel accepts at least
    tiled: bool  # has a tiling config (XLA has none)

    def padded_rows(self, rows: int, tiling) -> int:
        """The lhs rows a caller must pass: megablox and tokamax need a multiple of the row tile."""
        if not self.tiled:
            return rows
        return round_up(max(rows, self.min_rows), tiling[0])

    def padded_matmul(self, lhs, rhs, sizes, transpose_rhs, tiling):
        rows = lhs.shape[0]
        padded = self.padded_rows(rows, tiling)
        if padded != rows:
            lhs = jnp.pad(lhs, ((0, padded - rows), (0, 0)))
        return self.matmul(lhs, rhs, sizes, transpose_rhs, tiling)[:rows]

    def replay_context(self):
        """tokamax's grid as a plain pallas_call, so perf's replay sees it (`tpu_kernels.perf.tokamax_kernels`)."""
        return tokamax_kernels.grid_as_pallas_call() if self.name == "tokamax" else contextlib.nullcontext()

    def lowering_lock(self):
        """Lowerings of tokamax code must not interleave with a replay under its patch."""
        return tokamax_kernels.TOKAMAX_LOCK if self.name == "tokamax" else contextlib.nullcontext()


RIVALS = {
    "megablox": Rival("megablox", megablox_matmul, 8, True),
    "tokamax": Rival("tokamax", tokamax_matmul, TOKAMAX_MIN_ROWS, True),
    "xla_ragged_dot": Rival("xla_ragged_dot", xla_matmul, 1, False),
}


def rival_layer(rival: Rival, model: Model, tilings):
    return functools.partial(user_layer, model=model, rival=rival, configs=tilings)


# ----------------------------------------------------------------------------- rival configs


def projections(case: Case) -> list[tuple[str, int, int]]:
    """(name, K, N) of the layer's two grouped matmuls."""
    h, i = case.model.hidden, case.model.intermediate
    return [("gate_up", h, 2 * i), ("down", i, h)]


def tokamax_tile_space(dim: int) -> set[int]:
    """tokamax's own autotuning values for a K or N tile (its `_get_autotuning_configs`)."""
    rounded = round_up(dim, 128)
    return {128 * 2**i for i in range(8) if 128 * 2**i <= rounded} | {rounded // 2**i for i in range(6)} | {dim}


def block_vmem_bytes(tiling) -> int:
    """Double-buffered lhs, rhs and out blocks (bf16) and the f32 accumulator of a megablox-style kernel."""
    tm, tk, tn = tiling
    return 2 * (tm * tk + tk * tn + tm * tn) * 2 + tm * tn * 4


def candidate_tilings(rival: Rival, rows: int, k: int, n: int) -> list[tuple[int, int, int]]:
    """The configs searched: per row tile, the largest (K, N) blocks that fit each generation's VMEM.

    Row tiles 128 (the tiling a user picks, and vLLM's gmm_v2), 256, 512
    (tokamax: its own range, 64..1024 and at most the rows); K and N blocks
    whole, halved or quartered (tokamax: only values of its own space). Both
    kernels keep Mosaic's default scoped VMEM limit (16 MiB on v5e, 32 MiB on
    v6e), so each generation gets the largest blocks under its limit.
    """
    if not rival.tiled:
        return [None]
    limits = {tpu_generation(g).default_scoped_vmem_bytes for g in GENERATIONS}
    splits_k = [k, round_up(-(-k // 2), 128), round_up(-(-k // 4), 128)]
    splits_n = [n, round_up(-(-n // 2), 128), round_up(-(-n // 4), 128)]
    if rival.name == "tokamax":
        # Its space also holds non-multiples of 128 (K / 2 of an unaligned K), which Pallas cannot lower
        # unless they span the whole dimension.
        def lowerable(values, dim):
            return sorted({v for v in values if v >= 256 and (v % 128 == 0 or v == dim)}, reverse=True)[:4]

        splits_k = lowerable(tokamax_tile_space(k), k)
        splits_n = lowerable(tokamax_tile_space(n), n)
    padded_rows = round_up(max(rows, rival.min_rows), 128)
    row_tiles = [t for t in ROW_TILES if t <= max(padded_rows, 128)]
    blocks = sorted({(tk, tn) for tk in splits_k for tn in splits_n}, key=lambda b: (-b[0] * b[1], -b[1]))
    found = []
    for tm in row_tiles:
        for limit in limits:
            fitting = [(tm, tk, tn) for tk, tn in blocks if block_vmem_bytes((tm, tk, tn)) <= limit]
            if fitting and fitting[0] not in found:
                found.append(fitting[0])
    return found


# ----------------------------------------------------------------------------- cache


def _versions() -> str:
    import importlib.metadata as md

    names = ("jax", "jaxlib", "tokamax", "libtpu", "torch_tpu")
    found = []
    for name in names:
        try:
            found.append(f"{name}={md.version(name)}")
        except md.PackageNotFoundError:
            pass
    return ";".join(found)


def _source_of(module) -> str:
    import inspect

    return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:16]


class Cache:
    """Compiles and replays on disk (module docstring).

    A compile's key is the lowered module's text and the library versions: what the compiler sees. A
    replay's key adds perf.py's source, whose replay produced it. The model's pricing (perf's and
    xla_program's formulas and constants, hardware.py) is never part of a key: cached compiles and replays
    are re-priced on every run.
    """

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.versions = _versions()
        self.replay_code = _source_of(perf)
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        if folder:
            folder.mkdir(parents=True, exist_ok=True)

    def key(self, kind: str, *parts) -> str:
        digest = hashlib.sha256(f"{kind}|{self.versions}".encode())
        if kind == "replay":
            digest.update(f"|{self.replay_code}".encode())
        for part in parts:
            digest.update(part if isinstance(part, bytes) else str(part).encode())
        return f"{kind}-{digest.hexdigest()[:32]}"

    def get(self, key: str):
        if self.folder is None:
            return None
        path = self.folder / f"{key}.pkl"
        with self._lock:
            if not path.is_file():
                self.misses += 1
                return None
            self.hits += 1
        return pickle.loads(path.read_bytes())

    def put(self, key: str, value):
        if self.folder is None:
            return value
        path = self.folder / f"{key}.pkl"
        temporary = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_bytes(pickle.dumps(value))
        temporary.replace(path)
        return value


class PhaseClock:
    """Seconds spent per phase of the run (summed over threads), for the run's facts (raw/, untracked)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            with self.lock:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


CLOCK = PhaseClock()


def replay(cache: Cache, fn, args, context=contextlib.nullcontext) -> perf.ProgramReplay:
    """perf's replay of `fn(*args)` (its pallas_calls and XLA ragged dots), cached by its jaxpr and concrete
    arguments."""
    with context(), CLOCK("replay"):
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        concrete = b"".join(np.asarray(a).tobytes() for a in args if not isinstance(a, jax.ShapeDtypeStruct))
        key = cache.key("replay", jaxpr, concrete)
        found = cache.get(key)
        if found is not None:
            return found
        return cache.put(key, perf.replay_program(fn, *args))


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else repr(error)


class Compiler:
    """Lowers on the calling thread (cheap, and tokamax's patch is thread-global) and compiles on a pool.

    A compile is stored as `calibration.CompiledText` (or the compiler's refusal) under the lowered text;
    each result is analysed under the current model when it is read.
    """

    def __init__(self, cache: Cache, jobs: int):
        self.cache = cache
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1))

    def submit(self, fn, avals, generation: str, lock=contextlib.nullcontext(), *,
               kernel_bodies: bool = True) -> concurrent.futures.Future:
        """A future of the `xla_program.CompiledProgram` of `fn` for `generation`, or of {"error": ...}."""
        try:
            with lock, CLOCK("lower"):
                lowered = xla_program.lower_program(fn, avals, generation, kernel_bodies=kernel_bodies)
        except Exception as error:  # noqa: BLE001 - a layer that does not lower is a result
            return _resolved({"error": f"lowering failed: {_first_line(error)}"})
        with CLOCK("lowered text"):
            key = self.cache.key("compile", generation, lowered.as_text())
        found = self.cache.get(key)
        if found is not None:
            return _resolved(_analysed(found, generation))

        def compile_and_store():
            try:
                phase = "with kernel bodies" if kernel_bodies else "with empty kernel bodies"
                with CLOCK("compile (summed over threads)"), CLOCK(f"compile {phase} (summed over threads)"):
                    text = calibration.compile_text(lowered)
            except Exception as error:  # noqa: BLE001 - a failed compile (e.g. VMEM OOM) is a result
                text = {"error": _first_line(error)}
            return _analysed(self.cache.put(key, text), generation)

        return self.pool.submit(compile_and_store)


def _resolved(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def _analysed(text, generation: str):
    if isinstance(text, dict):
        return dict(text)
    with CLOCK("analyse HLO"):
        return text.analyse(generation)


# ----------------------------------------------------------------------------- modelling


def price(program, replayed: perf.ProgramReplay, hbm_fraction: float = 1.0) -> xla_program.ProgramTime:
    """The layer under the calibrated model: Pallas kernels, XLA's ragged-dot loops and the other XLA ops."""
    return xla_program.model_program(program, replayed.pallas_calls, ragged_dots=replayed.ragged_dots,
                                     hbm_fraction=hbm_fraction)


def timings(program, replayed: perf.ProgramReplay, case: Case, generation: str) -> dict:
    """Modelled layer time (headline: calibrated pipelined figure), its error band, and where it goes.

    A program the model cannot price (an XLA ragged-dot loop whose bounds XLA left empty) gives
    {"modelled": False, "error": why}.
    """
    try:
        head = price(program, replayed)
        at_85 = price(program, replayed, hbm_fraction=0.85)
    except ValueError as error:
        return {"modelled": False, "error": f"not modelled: {_first_line(error)}"}
    kernels = head.kernels
    peak = tpu_generation(generation).bf16_flops_per_s
    placed = xla_program.kernels_as_placed(program, replayed.pallas_calls) if replayed.pallas_calls else []
    kernels_s = kernels.pipelined_time_s if kernels else 0.0
    band = calibration_bands.band({"pallas_ragged_dot": kernels_s, "xla_ragged_dot": head.ragged_dot_s},
                                  generation, uncalibrated_s=head.xla_s)
    return {
        "headline_us": round(head.pipelined_time_s * 1e6, 3),
        "band": band,
        "us": {"pipelined": round(head.pipelined_time_s * 1e6, 3),
               "pipelined_hbm85": round(at_85.pipelined_time_s * 1e6, 3),
               "overlap": round(head.time_s * 1e6, 3)},
        # The same, with the XLA ops at XLA's own cycle estimate where that is higher (ops without one excluded).
        "with_xla_estimate_us": round(
            (head.pipelined_time_s - head.xla_s + max(head.xla_s, head.xla_estimated_s)) * 1e6, 3),
        "over_roofline": head.pipelined_time_s / case.roofline_s(generation),
        "mxu_utilisation_pct": 100.0 * case.useful_flops / peak / head.pipelined_time_s,
        "kernels": None if kernels is None else {
            "us": round(kernels_s * 1e6, 3),
            "overlap_us": round(kernels.time_s * 1e6, 3),
            "hbm_bytes": kernels.hbm_bytes,
            "hbm_us": round(kernels.hbm_bound_s * 1e6, 3),
            "mxu_us": round(kernels.compute_bound_s * 1e6, 3),
            "grid_steps": kernels.steps,
            "step_cost_us": round(kernels.overhead_s * 1e6, 3),
            "mxu_flops": kernels.mxu_flops,
            "fits_vmem": kernels.fits_vmem,
            "vmem_bytes": kernels.vmem_bytes,
            "calls": [{"name": c.name, "grid": list(c.grid), "hbm_bytes": c.hbm_bytes, "steps": c.steps,
                       "notes": list(c.notes)} for c in placed],
        },
        "xla_ragged_dot_us": round(head.ragged_dot_s * 1e6, 3),
        "xla_ops": {
            "us": round(head.xla_s * 1e6, 3),
            "hbm_bytes": head.xla_hbm_bytes,
            "vmem_bytes": head.xla_vmem_bytes,
            "flops": head.xla_flops,
            "count": head.xla_ops,
            "xla_estimated_cycles": head.xla_estimated_cycles,
            "xla_estimated_us": round(head.xla_estimated_s * 1e6, 3),
            "ops_without_xla_estimate": head.xla_ops_without_estimate,
            "relayout_hbm_bytes": program.relayout_bytes,
            "relayout_us": round(program.relayout_bytes / tpu_generation(generation).hbm_bytes_per_s * 1e6, 3),
        },
        "hbm_bytes": head.hbm_bytes,
        "bytes_over_min": head.hbm_bytes / case.min_bytes,
        "placements": program.placements(),
        "memory": program.memory,
        "notes": list(program.notes),
    }


def why_rival_wins(ours: dict, rival: dict, name: str) -> str:
    """The model's account of a rival's lead: which term differs (headline model, us and bytes)."""
    def term(variant, path):
        value = variant
        for key in path:
            value = (value or {}).get(key, 0)
        return value or 0

    def matmuls_us(variant):  # the grouped matmuls: Pallas kernels, or XLA's ragged-dot loops
        return term(variant, ("kernels", "us")) + term(variant, ("xla_ragged_dot_us",))

    parts = []
    compared = [("grouped-matmul us", matmuls_us(ours), matmuls_us(rival)),
                ("other XLA-op us", term(ours, ("xla_ops", "us")), term(rival, ("xla_ops", "us"))),
                ("all HBM bytes", term(ours, ("hbm_bytes",)), term(rival, ("hbm_bytes",))),
                ("grid-step cost us", term(ours, ("kernels", "step_cost_us")), term(rival, ("kernels", "step_cost_us")))]
    if rival.get("kernels"):  # where both run kernels, which side of the kernel boundary the bytes are on
        compared += [(label, term(ours, path), term(rival, path)) for label, path in
                     (("kernel HBM bytes", ("kernels", "hbm_bytes")), ("XLA-op HBM bytes", ("xla_ops", "hbm_bytes")),
                      ("kernel MXU us", ("kernels", "mxu_us")))]
    for label, mine, theirs in compared:
        if mine > theirs * 1.01 + 1e-9:
            parts.append(f"{label}: ours {mine:,.6g} vs {name} {theirs:,.6g}")
    return "; ".join(parts) or "within the model's rounding"


def standalone(replayed: perf.ProgramReplay, generation: str) -> perf.ModelledTime:
    """A rival's grouped matmul alone, under the calibrated model (its pallas_calls)."""
    return perf.roofline(list(replayed.pallas_calls), generation)


def joined(replays) -> perf.ProgramReplay:
    """Several replays (one per projection) as one program's, in order."""
    return perf.ProgramReplay(tuple(c for r in replays for c in r.pallas_calls),
                              tuple(d for r in replays for d in r.ragged_dots))


def rival_replay(cache: Cache, rival: Rival, case: Case, projection: str, k: int, n: int, tiling):
    """The replay of one projection's grouped matmul by `rival` at `tiling`, on the case's group sizes."""
    _, transposed = stored_order(case.model, projection)
    experts = case.setting.local_experts
    lhs = jax.ShapeDtypeStruct((rival.padded_rows(case.picks, tiling), k), DTYPE)
    rhs = jax.ShapeDtypeStruct((experts, n, k) if transposed else (experts, k, n), DTYPE)
    fn = functools.partial(rival.matmul, transpose_rhs=transposed, tiling=tiling)
    return replay(cache, lambda x, w, s, fn=fn: fn(x, w, s), (lhs, rhs, case.group_sizes), rival.replay_context)


def tune_rival(cache: Cache, rival: Rival, case: Case) -> dict:
    """Each candidate config's replay per projection, and per generation the best standalone config that fits.

    The standalone best is what a sweep over the grouped matmul alone finds
    (tokamax's autotuner works that way); it is the config compiled into the
    layer. `best_in_layer` then re-ranks every fitting pair inside the
    compiled layer, where XLA's placement can change the ranking. Ranked by
    the calibrated pipelined figure.
    """
    options = []  # per projection: [(tiling, replay)]
    searched = []
    for projection, k, n in projections(case):
        found = []
        for tiling in candidate_tilings(rival, case.picks, k, n):
            replayed = rival_replay(cache, rival, case, projection, k, n, tiling)
            found.append((tiling, replayed))
            searched.append({
                "projection": projection, "tiling": list(tiling),
                "standalone_us": {g: round(standalone(replayed, g).pipelined_time_s * 1e6, 3) for g in GENERATIONS},
                "fits_vmem": {g: standalone(replayed, g).fits_vmem for g in GENERATIONS},
            })
        options.append(found)
    best, ranked = {}, {}
    for generation in GENERATIONS:
        fitting = []
        for projection, found in zip(projections(case), options):
            fits = sorted(((standalone(r, generation).pipelined_time_s, t, r) for t, r in found
                           if standalone(r, generation).fits_vmem), key=lambda item: item[0])
            if not fits:
                raise RuntimeError(f"{case.label} {rival.name} {projection[0]}: no candidate fits {generation}'s VMEM")
            fitting.append(fits)
        pairs = sorted(((a[0] + b[0], [(a[1], a[2]), (b[1], b[2])]) for a in fitting[0] for b in fitting[1]),
                       key=lambda item: item[0])
        ranked[generation] = [pair for _, pair in pairs]
        best[generation] = ranked[generation][0]
    return {"per_generation": best, "ranked": ranked, "options": options, "searched": searched}


def best_in_layer(program, options, case: Case, generation: str, refused=()):
    """The pair of fitting configs (gate_up, down) with the least modelled layer time under `program`'s placement,
    but the pairs whose layer Mosaic `refused` to compile."""
    best = None
    for first in options[0]:
        for second in options[1]:
            pair = (first, second)
            if [first[0], second[0]] in refused:
                continue
            if not all(standalone(r, generation).fits_vmem for _, r in pair):
                continue
            replayed = joined(r for _, r in pair)
            time_s = price(program, replayed).pipelined_time_s
            if best is None or time_s < best[0]:
                best = (time_s, [t for t, _ in pair], replayed)
    return best


def tokamax_pick(case: Case, projection: str, k: int, n: int) -> tuple[int, int, int, int]:
    """(tile_m, tile_k, tile_n, input_buffer_count) tokamax 0.0.12 picks for one projection, untuned.

    Its op looks the call up in its autotuning cache (measurements shipped for v5e and TPU7x; none holds a
    call of these shapes), then in its heuristics: a lookup table keyed by (m, k, n, groups, quantized)
    (`GMM_TILING_TUNED_LUT`, or `GMM_RHS_TRANSPOSE_TILING_TUNED_LUT` for weights stored [E, N, K]), else
    its default `Config()`, (128, 128, 128) with 2 input buffers.
    """
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_op

    _, transposed = stored_order(case.model, projection)
    rows = round_up(max(case.picks, TOKAMAX_MIN_ROWS), 128)
    table = tokamax_op.GMM_RHS_TRANSPOSE_TILING_TUNED_LUT if transposed else tokamax_op.GMM_TILING_TUNED_LUT
    # The transposed table's key names the output dimension k and the contracting one n (its dlhs use).
    key = (rows, n, k, case.setting.local_experts, False) if transposed else (
        rows, k, n, case.setting.local_experts, False)
    if key in table:
        # Its values go to the kernel as they are: tile_k along the contracting dimension either way.
        (tile_m, tile_k, tile_n), buffers = table[key]
        return tile_m, tile_k, tile_n, buffers
    default = tokamax_op.Config()
    return default.tile_m, default.tile_k, default.tile_n, default.input_buffer_count


def tokamax_default(cache: Cache, case: Case) -> list:
    """tokamax's kernel at its own untuned pick (`tokamax_pick`), per projection: (tiling, replay)."""
    rival = RIVALS["tokamax"]
    result = []
    for projection, k, n in projections(case):
        tiling = tokamax_pick(case, projection, k, n)
        result.append((tiling, rival_replay(cache, rival, case, projection, k, n, tiling)))
    return result


# The extra row of tokamax's kernel at its own untuned pick (the kernel Hugging Face's ragged-dot-tpu ships).
TOKAMAX_DEFAULT = "tokamax_default"


def measure_case(built, case: Case, cache: Cache, compiler: Compiler, rivals: list[str],
                 generations: tuple[str, ...] = GENERATIONS):
    """Replays `case`'s kernels, queues its compiles, and returns a function that waits for them and builds its rows
    (one per generation)."""
    replay_args = case.avals(concrete_index=True)
    compile_avals = case.avals(concrete_index=False)
    pending = {}  # (variant, generation) -> (future of the compiled program, replay, tilings)
    for generation in generations:
        layer = ours_layer(built, case.model, generation)
        pending[("ours", generation)] = (compiler.submit(layer, compile_avals, generation),
                                         replay(cache, layer, replay_args), None)
        if case.phase == "decode":
            for scheme in QUANTIZED:
                layer = quantized_layer(built, case.model, generation)
                pending[(f"ours_{scheme}", generation)] = (
                    compiler.submit(layer, quantized_avals(built, case, scheme, False), generation),
                    replay(cache, layer, quantized_avals(built, case, scheme, True)), None)
    tunings = {}
    for name in rivals:
        rival = RIVALS[name]
        if rival.tiled:
            tunings[name] = tune_rival(cache, rival, case)
        else:  # XLA's ragged dots: replayed inside the layer, with the case's group sizes
            replayed = replay(cache, rival_layer(rival, case.model, [None, None]), replay_args)
        for generation in generations:
            if rival.tiled:
                chosen = tunings[name]["per_generation"][generation]
                tilings = [tiling for tiling, _ in chosen]
                replayed = joined(r for _, r in chosen)
            else:
                tilings = None
            layer = rival_layer(rival, case.model, tilings or [None, None])
            future = compiler.submit(layer, compile_avals, generation, rival.lowering_lock(), kernel_bodies=False)
            pending[(name, generation)] = (future, replayed, tilings)
    if "tokamax" in rivals:
        defaults = tokamax_default(cache, case)
        tilings = [tiling for tiling, _ in defaults]
        for generation in generations:
            layer = rival_layer(RIVALS["tokamax"], case.model, tilings)
            pending[(TOKAMAX_DEFAULT, generation)] = (
                compiler.submit(layer, compile_avals, generation, RIVALS["tokamax"].lowering_lock(),
                                kernel_bodies=False),
                joined(r for _, r in defaults), tilings)

    def finish() -> list[dict]:
        rows = []
        for generation in generations:
            row = {
                "label": case.label, "setting": case.setting.label, "model": case.model.name, "ep": case.setting.ep,
                "mode": case.setting.mode, "tokens": case.tokens, "phase": case.phase, "generation": generation,
                "rows": case.rows, "picks": case.picks, "live_picks": case.live_picks,
                "active_experts": case.active_experts, "local_experts": case.setting.local_experts,
                "min_bytes": case.min_bytes, "useful_flops": case.useful_flops,
                "roofline_us": round(case.roofline_s(generation) * 1e6, 3),
                "roofline_bound": "compute" if case.useful_flops / tpu_generation(generation).bf16_flops_per_s
                > case.min_bytes / tpu_generation(generation).hbm_bytes_per_s else "hbm",
                "variants": {},
            }
            for (name, gen), (future, replayed, tilings) in pending.items():
                if gen != generation:
                    continue
                program = future.result()
                refused = []
                if isinstance(program, dict) and name in tunings:
                    # The compiler refused the standalone best inside the layer: the rival's best is then the
                    # next pair by standalone time that compiles.
                    for pair in tunings[name]["ranked"][generation][1:1 + MAX_COMPILE_FALLBACKS]:
                        refused.append({"tiling": list(tilings), "error": program["error"]})
                        tilings, replayed = [t for t, _ in pair], joined(r for _, r in pair)
                        program = compiler.submit(rival_layer(RIVALS[name], case.model, tilings), compile_avals,
                                                  generation, RIVALS[name].lowering_lock(),
                                                  kernel_bodies=False).result()
                        if not isinstance(program, dict):
                            break
                if isinstance(program, dict):
                    row["variants"][name] = {"compiled": False, **program, "refused_tilings": refused}
                    continue
                entry = {"compiled": True, **timings(program, replayed, case, generation)}
                if name != "ours" and not name.startswith("ours_"):
                    entry["kernel_bodies"] = ("empty in the compile (the XLA program and placements are the layer's; "
                                              "Mosaic's check of the bodies is not made)")
                if name.startswith("ours_"):
                    scheme = name.removeprefix("ours_")
                    minimum = quantized_min_bytes(built, case, scheme)
                    entry = {"extra_row": f"ours with {scheme} expert weights (issue 14); over_roofline is against "
                                          "the bf16 roofline", **entry, "quantized_min_bytes": minimum}
                    if "hbm_bytes" in entry:
                        entry["bytes_over_quantized_min"] = entry["hbm_bytes"] / minimum
                if name == TOKAMAX_DEFAULT:
                    entry["extra_row"] = ("tokamax's kernel at tokamax 0.0.12's own untuned pick (its autotuning "
                                          "cache holds none of these calls; its lookup table, else Config(): "
                                          "128^3, 2 buffers); the kernel kernels-community/ragged-dot-tpu ships")
                if refused:
                    entry["refused_tilings"] = refused
                if tilings and tilings[0] is not None:
                    entry["tiling"] = {"gate_up": list(tilings[0]), "down": list(tilings[1])}
                if name in tunings and entry.get("modelled", True):
                    _, best_tilings, best_replay = best_in_layer(program, tunings[name]["options"], case, generation,
                                                                 refused=[r["tiling"] for r in refused])
                    if best_tilings != list(tilings):
                        entry = {"compiled": True, "kernel_bodies": entry["kernel_bodies"],
                                 "placement_from": f"the layer compiled at the standalone best {tilings}",
                                 **timings(program, best_replay, case, generation),
                                 "tiling": {"gate_up": list(best_tilings[0]), "down": list(best_tilings[1])},
                                 "standalone_best_tiling": {"gate_up": list(tilings[0]), "down": list(tilings[1])},
                                 "standalone_best_us": entry["headline_us"]}
                row["variants"][name] = entry
            for name in rivals:
                if name in tunings:
                    row.setdefault("rival_search", {})[name] = tunings[name]["searched"]
            summarise(row, rivals)
            rows.append(row)
        return rows

    return finish


def modelled(variant: dict | None) -> bool:
    return bool(variant) and variant.get("compiled") is True and "headline_us" in variant


def summarise(row: dict, rivals: list[str]) -> None:
    """Best tuned rival, ours against it and against the roofline, and why a rival wins where one does."""
    for key in ("rival_wins_by_pct", "why_rival_wins", "best_rival_us", "ours_us", "ours_over_best_rival",
                "ours_over_roofline", "ours_band_p90_us", "rivals_not_modelled"):
        row.pop(key, None)
    ours = row["variants"].get("ours")
    candidates = [(row["variants"][name]["headline_us"], name) for name in rivals if modelled(row["variants"].get(name))]
    not_modelled = {name: row["variants"][name].get("error") for name in rivals
                    if name in row["variants"] and not modelled(row["variants"][name])}
    if not_modelled:
        row["rivals_not_modelled"] = not_modelled
    if not modelled(ours) or not candidates:
        row["best_rival"] = None
        return
    best_us, best = min(candidates)
    row["best_rival"] = best
    row["best_rival_us"] = best_us
    row["ours_us"] = ours["headline_us"]
    row["ours_band_p90_us"] = ours["band"]["p90_us"]
    row["ours_over_best_rival"] = ours["headline_us"] / best_us
    row["ours_over_roofline"] = ours["over_roofline"]
    if ours["headline_us"] > best_us * 1.0001:
        row["rival_wins_by_pct"] = 100.0 * (ours["headline_us"] / best_us - 1.0)
        why = why_rival_wins(ours, row["variants"][best], best)
        if best == "xla_ragged_dot":
            rival = row["variants"][best]
            why += (f"; caveat: XLA's ragged-dot loop is priced by its calibrated replay, its other ops carry no "
                    f"fixed cost per op (Pallas kernels pay {grid_step_s(row['generation']) * 1e6:.2f} us per "
                    f"grid step); at XLA's own cycle estimates for those ops the XLA layer takes "
                    f"{rival['with_xla_estimate_us']:.1f} us and ours {ours['with_xla_estimate_us']:.1f} us")
        row["why_rival_wins"] = why


# ----------------------------------------------------------------------------- targets and plot


def where_time_goes(row: dict) -> dict:
    """Our layer's modelled time split into the terms a miss can come from (headline model, us)."""
    ours = row["variants"]["ours"]
    kernels = ours.get("kernels") or {}
    relayout = ours["xla_ops"].get("relayout_us", 0.0)
    # Where the relayout's copy lands in VMEM the kernel reads it there: without the relayout it would read those
    # bytes from HBM, so dropping the relayout's time alone would undercount.
    kernel_reads_vmem = any("read from VMEM" in line for line in ours.get("placements", []))
    without = None if relayout and kernel_reads_vmem else round((ours["headline_us"] - relayout) / row["roofline_us"], 4)
    return {
        "roofline_us": row["roofline_us"],
        "ours_us": ours["headline_us"],
        "relayout_us": relayout,
        "other_xla_ops_us": round(ours["xla_ops"]["us"] - relayout, 3),
        "kernels_us": kernels.get("us", 0.0),
        "kernels_hbm_us": kernels.get("hbm_us", 0.0),
        "kernels_mxu_us": kernels.get("mxu_us", 0.0),
        "kernels_grid_steps": kernels.get("grid_steps", 0),
        "kernels_step_cost_us": kernels.get("step_cost_us", 0.0),
        "over_roofline_without_relayout": without,
    }


def chunked_mxu_floor_s(case: Case, generation: str) -> float:
    """MXU time of the two grouped matmuls if every pass had its own group's rows and nothing else.

    Under the per-pass model a group of g rows run in static chunks of one
    MXU width costs ceil(g / mxu) passes of mxu rows per weights tile (a
    chunk's rows belong to one group; a partial last chunk costs a whole
    pass), and K and N are padded to whole tiles. This is the least MXU time
    any kernel with static row chunks reaches: the ceiling of its
    utilisation, before grid-step costs and the XLA ops around it.
    """
    facts = tpu_generation(generation)
    mxu = facts.mxu_size
    rows = sum(math.ceil(int(g) / mxu) * mxu for g in case.group_sizes)
    flops = sum(2 * rows * round_up(k, mxu) * round_up(n, mxu) for _, k, n in projections(case))
    return flops / facts.bf16_flops_per_s


def band_text(variant: dict) -> str:
    """"lo-hi us" of a variant's p90 band."""
    lo, hi = variant["band"]["p90_us"]
    return f"{lo:.1f}-{hi:.1f}"


def check_targets(rows: list[dict]) -> dict:
    """Issue 13's targets on the headline (calibrated pipelined) figure, each with its calibrated band."""
    def headline(row):
        return row.get("ours_us")

    cases = {(s.label, t): None for s in SETTINGS for t in DECODE_TOKENS + PREFILL_TOKENS}

    def case_of(row) -> Case:
        key = (row["setting"], row["tokens"])
        if cases.get(key) is None:
            setting = next(s for s in SETTINGS if s.label == row["setting"])
            cases[key] = make_case(setting, row["tokens"])
        return cases[key]

    anchors = {}
    for shape in (ANCHOR, ANCHOR_DISPATCH):
        anchor = next((r for r in rows if (r["setting"], r["tokens"], r["generation"]) == shape), None)
        ours = None if anchor is None else anchor["variants"].get("ours")
        anchors[" ".join(map(str, shape))] = {
            "target_us": ANCHOR_TARGET_US,
            "ours_us": None if anchor is None else headline(anchor),
            "ours_band_p90_us": ours["band"]["p90_us"] if modelled(ours) else None,
            "roofline_us": None if anchor is None else anchor["roofline_us"],
            "overlap_us": ours["us"]["overlap"] if modelled(ours) else None,
            "best_rival": None if anchor is None else anchor.get("best_rival"),
            "best_rival_us": None if anchor is None else anchor.get("best_rival_us"),
            "meets": anchor is not None and headline(anchor) is not None and headline(anchor) <= ANCHOR_TARGET_US,
            "meets_across_p90_band": modelled(ours) and ours["band"]["p90_us"][1] <= ANCHOR_TARGET_US,
        }
    decode = []
    for r in rows:
        if r["phase"] != "decode":
            continue
        entry = {"label": r["label"], "generation": r["generation"], "ours_over_roofline": r.get("ours_over_roofline"),
                 "meets": r.get("ours_over_roofline") is not None and r["ours_over_roofline"] <= DECODE_MAX_OVER_ROOFLINE}
        if r.get("ours_over_roofline") is not None and not entry["meets"]:
            entry["where_time_goes"] = where_time_goes(r)
        decode.append(entry)
    prefill = []
    for r in rows:
        if not (r["phase"] == "prefill" and r["generation"] == "v5e" and r["roofline_bound"] == "compute"
                and modelled(r["variants"].get("ours"))):
            continue
        useful_s = r["useful_flops"] / tpu_generation("v5e").bf16_flops_per_s
        ceiling = 100.0 * useful_s / chunked_mxu_floor_s(case_of(r), "v5e")
        prefill.append({
            "label": r["label"], "generation": r["generation"],
            "mxu_utilisation_pct": round(r["variants"]["ours"].get("mxu_utilisation_pct"), 2),
            "meets": r["variants"]["ours"].get("mxu_utilisation_pct", 0) >= PREFILL_MIN_MXU_PCT,
            "static_chunk_ceiling_pct": round(ceiling, 2),
            "kernels_mxu_flops_over_useful": round(r["variants"]["ours"]["kernels"]["mxu_flops"] / r["useful_flops"], 4),
            "where_time_goes": where_time_goes(r),
        })
    losses = [
        {"label": r["label"], "generation": r["generation"], "rival": r["best_rival"],
         "rival_wins_by_pct": round(r["rival_wins_by_pct"], 2), "why": r["why_rival_wins"]}
        for r in rows if "rival_wins_by_pct" in r
    ]
    return {
        "headline": "calibrated pipelined figure (each grid step max(compute, neighbours' copies) + the generation's "
                    "fitted step cost), peak HBM bandwidth; bands: calibration_bands",
        "anchor": anchors,
        "decode_max_over_roofline": DECODE_MAX_OVER_ROOFLINE,
        "decode_meets": sum(d["meets"] for d in decode),
        "decode_shapes": len(decode),
        "decode": decode,
        "prefill_v5e_compute_bound_min_mxu_pct": PREFILL_MIN_MXU_PCT,
        "prefill_static_chunk_ceiling": "chunked_mxu_floor_s: useful FLOPs over the MXU work of one-MXU-width row "
                                        "chunks per group (a partial last chunk a whole pass), K and N padded to "
                                        "the MXU: the most a kernel with static MXU-wide row chunks reaches",
        "prefill_meets": sum(p["meets"] for p in prefill),
        "prefill": prefill,
        "not_slower_than_best_rival": not losses,
        "rival_wins": losses,
        "quantized": quantized_targets(rows),
    }


def quantized_targets(rows: list[dict]) -> dict:
    """Issue 14's targets: the anchor with int8 weights, and every decode shape's bytes against the quantized minimum."""
    anchor = next((r for r in rows if (r["setting"], r["tokens"], r["generation"]) == ANCHOR), None)
    result = {"max_bytes_over_quantized_min": QUANTIZED_MAX_BYTES_OVER_MIN, "anchor": {}, "decode": []}
    for scheme in QUANTIZED:
        variant = None if anchor is None else anchor["variants"].get(f"ours_{scheme}")
        us = variant["headline_us"] if modelled(variant) else None
        result["anchor"][scheme] = {"ours_us": us, "bf16_us": None if anchor is None else anchor.get("ours_us"),
                                    "ours_band_p90_us": variant["band"]["p90_us"] if modelled(variant) else None,
                                    "target_us": QUANTIZED_ANCHOR_TARGET_US.get(scheme),
                                    "meets": None if scheme not in QUANTIZED_ANCHOR_TARGET_US or us is None
                                    else us <= QUANTIZED_ANCHOR_TARGET_US[scheme]}
    for r in rows:
        for scheme in QUANTIZED:
            variant = r["variants"].get(f"ours_{scheme}")
            if not modelled(variant):
                continue
            result["decode"].append({
                "label": r["label"], "generation": r["generation"], "scheme": scheme, "us": variant["headline_us"],
                "bf16_us": r.get("ours_us"), "bytes_over_quantized_min": round(variant["bytes_over_quantized_min"], 4),
                "meets": variant["bytes_over_quantized_min"] <= QUANTIZED_MAX_BYTES_OVER_MIN})
    result["decode_meets"] = sum(d["meets"] for d in result["decode"])
    result["decode_shapes"] = len(result["decode"])
    return result


def markdown_table(rows: list[dict]) -> str:
    """Ours vs the best tuned rival vs the roofline per shape and generation (headline model), as markdown."""
    lines = [
        "| shape | gen | roofline us | ours us | ours p90 band us | ours / roofline | best tuned rival | rival us "
        "| ours / rival | tokamax untuned us | ours at XLA's glue estimate us |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        ours = row["variants"].get("ours", {})
        untuned = row["variants"].get(TOKAMAX_DEFAULT, {})
        untuned_us = f"{untuned['headline_us']:.1f}" if modelled(untuned) else untuned.get("error", "")
        if row.get("best_rival") is None:
            lines.append(f"| {row['label']} | {row['generation']} | {row['roofline_us']:.1f} | "
                         f"{ours.get('headline_us', ours.get('error', 'n/a'))} | | | | | | {untuned_us} | |")
            continue
        lines.append(
            f"| {row['label']} | {row['generation']} | {row['roofline_us']:.1f} | {row['ours_us']:.1f} | "
            f"{band_text(ours)} | {row['ours_over_roofline']:.3f} | {row['best_rival']} | "
            f"{row['best_rival_us']:.1f} | {row['ours_over_best_rival']:.3f} | {untuned_us} | "
            f"{ours.get('with_xla_estimate_us', float('nan')):.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(GENERATIONS), 1, figsize=(22, 6 * len(GENERATIONS)))
    for ax, generation in zip(axes, GENERATIONS):
        selected = [r for r in rows if r["generation"] == generation and r.get("best_rival")]
        x = np.arange(len(selected))
        ours = [r["ours_over_roofline"] for r in selected]
        rival = [r["best_rival_us"] / r["roofline_us"] for r in selected]
        # The p90 calibrated band of ours (calibration_bands).
        errors = np.array([[value - r["ours_band_p90_us"][0] / r["roofline_us"],
                            r["ours_band_p90_us"][1] / r["roofline_us"] - value] for value, r in zip(ours, selected)])
        ax.bar(x - 0.2, ours, 0.4, color="#1b7837", label="ours (bar: p90 calibrated band)",
               yerr=errors.T if len(errors) else None, error_kw={"linewidth": 0.6})
        ax.bar(x + 0.2, rival, 0.4, color="#762a83", label="best tuned rival (name above bar)")
        for position, r, value in zip(x, selected, rival):
            ax.text(position + 0.2, value * 1.05, r["best_rival"].replace("_ragged_dot", ""), rotation=90,
                    ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8, label="roofline")
        ax.axhline(DECODE_MAX_OVER_ROOFLINE, color="grey", linestyle="--", linewidth=0.8,
                   label=f"decode target {DECODE_MAX_OVER_ROOFLINE}x")
        ax.set_yscale("log")
        ax.set_ylabel("modelled time / roofline")
        ax.set_title(f"{generation}: one experts layer, calibrated pipelined model, peak HBM bandwidth"
                     + (" (v5e's constants: no v6e measurements)" if generation == "v6e" else ""))
        ax.set_xticks(x, [f"{r['setting']} T={r['tokens']}" for r in selected], rotation=90, fontsize=7)
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def priority(case: Case) -> tuple:
    """The order cases are modelled in: the anchors (router masking, then dispatch), then decode by tokens, then
    prefill.

    The JSON is rewritten after every case, so a run stopped early still
    leaves the most important shapes complete.
    """
    shape = (case.setting.label, case.tokens)
    anchor = 0 if shape == ANCHOR[:2] else 1 if shape == ANCHOR_DISPATCH[:2] else 2
    return (anchor, case.phase != "decode", case.tokens)


# Cases whose replays run ahead of the one being finished: enough to keep the compile threads busy
# without front-loading every replay of the run.
LOOKAHEAD = 2


# ----------------------------------------------------------------------------- Hugging Face's 257 us case

HF_MEASURED_US = 257.0  # one Qwen3-30B-A3B experts layer on an EP8 v6e rank at 256 tokens (kernels-community)
HF_SHAPES = (ANCHOR, ANCHOR_DISPATCH)
# tokamax tiles from its own autotuning space probed at the HF shapes: how far the time moves with the tiles.
HF_PROBE_TILES = ((128, 128, 128), (128, 256, 256), (128, 512, 512), (128, 1024, 768), (256, 2048, 768))


def hf_case(rows: list[dict], cache: Cache) -> dict:
    """The layer Hugging Face measured at 257 us, modelled with the kernel it ships (tokamax's) at tokamax's pick.

    Per EP mode (the article does not say which; Qwen3's default in transformers is dispatch): the
    `tokamax_default` variant's time and terms, the step cost that would make it 257 us, and the standalone
    grouped matmuls at a few other tiles of tokamax's space.
    """
    calibrated = calibration_bands.error("pallas_ragged_dot", "v6e")
    result = {"measured_us": HF_MEASURED_US, "generation": "v6e",
              "constants": "v6e has no measurements: v5e's fitted constants (grid step "
                           f"{grid_step_s('v6e') * 1e6:.2f} us) and error (median {100 * calibrated['median']:.1f} %, "
                           f"p90 {100 * calibrated['p90']:.1f} %)",
              "shapes": {}}
    for shape in HF_SHAPES:
        row = next((r for r in rows if (r["setting"], r["tokens"], r["generation"]) == shape), None)
        if row is None or not modelled(row["variants"].get(TOKAMAX_DEFAULT)):
            continue
        variant = row["variants"][TOKAMAX_DEFAULT]
        kernels = variant["kernels"]
        without_steps = variant["headline_us"] - kernels["step_cost_us"]
        setting = next(s for s in SETTINGS if s.label == shape[0])
        case = make_case(setting, shape[1])
        probes = []
        for tiles in HF_PROBE_TILES:
            replays = [rival_replay(cache, RIVALS["tokamax"], case, projection, k, n, tiles)
                       for projection, k, n in projections(case)]
            modelled_alone = perf.roofline([c for r in replays for c in r.pallas_calls], "v6e")
            probes.append({"tiles": list(tiles), "grouped_matmuls_alone_us": round(modelled_alone.pipelined_time_s * 1e6, 1),
                           "grid_steps": modelled_alone.steps})
        result["shapes"][" ".join(map(str, shape))] = {
            "tokamax_pick": variant["tiling"],
            "predicted_us": variant["headline_us"],
            "band_p90_us": variant["band"]["p90_us"],
            "predicted_over_measured": round(variant["headline_us"] / HF_MEASURED_US, 3),
            "grid_steps": kernels["grid_steps"],
            "grid_step_cost_us": kernels["step_cost_us"],
            "without_step_cost_us": round(without_steps, 1),
            "kernels_hbm_us": kernels["hbm_us"],
            "xla_ops_us": variant["xla_ops"]["us"],
            "step_cost_that_gives_measured_us": (round((HF_MEASURED_US - without_steps) / kernels["grid_steps"], 4)
                                                 if kernels["grid_steps"] else None),
            "tokamax_tuned_us": row["variants"].get("tokamax", {}).get("headline_us"),
            "ours_us": row.get("ours_us"),
            "other_tiles": probes,
        }
    result["largest_step_share_in_calibration"] = largest_step_share()
    return result


def largest_step_share() -> dict:
    """Per chip, the measured Pallas ragged dot whose time the model gives most to grid-step cost.

    Says how far the fitted step cost has been tested: a layer of near-empty steps is outside that range.
    """
    report = json.loads(calibration_bands.CALIBRATION.read_text())
    best = {}
    for entry in report["entries"]:
        if entry["kind"] != "pallas_ragged_dot":
            continue
        share = entry["terms_us"]["kernel_steps"] * grid_step_s(entry["chip"]) * 1e6 / entry["measured_us"]
        if entry["chip"] not in best or share > best[entry["chip"]]["share"]:
            best[entry["chip"]] = {"share": round(share, 4), "call": entry["call"], "config": entry["config"],
                                   "steps": entry["terms_us"]["kernel_steps"], "measured_us": entry["measured_us"],
                                   "ratio": entry["ratio"]}
    return best


# ----------------------------------------------------------------------------- output


def _round(value):
    if isinstance(value, float):
        return float(f"{value:.5g}") if abs(value) >= 1e-3 or value == 0 else float(f"{value:.3g}")
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


SHAPE_FIELDS = ("label", "generation", "phase", "rows", "live_picks", "active_experts", "roofline_us",
                "roofline_bound", "ours_us", "ours_band_p90_us", "ours_over_roofline", "best_rival", "best_rival_us",
                "ours_over_best_rival", "rival_wins_by_pct", "why_rival_wins", "rivals_not_modelled")


def shape_lines(rows: list[dict]) -> list[dict]:
    """One line per (shape, generation): roofline, ours, the best tuned rival."""
    return [_round({k: row[k] for k in SHAPE_FIELDS if k in row}) for row in rows]


def variant_lines(rows: list[dict]) -> list[dict]:
    """One line per (shape, generation, variant): its headline, band and terms."""
    lines = []
    for row in rows:
        for name, v in sorted(row["variants"].items()):
            line = {"label": row["label"], "generation": row["generation"], "variant": name,
                    "compiled": v.get("compiled")}
            if not modelled(v):
                line["error"] = v.get("error")
                lines.append(line)
                continue
            kernels = v.get("kernels") or {}
            line.update({
                "us": v["headline_us"], "band_p90_us": v["band"]["p90_us"], "band_median_us": v["band"]["median_us"],
                "uncalibrated_us": v["band"]["uncalibrated_us"], "overlap_us": v["us"]["overlap"],
                "hbm85_us": v["us"]["pipelined_hbm85"], "kernels_us": kernels.get("us", 0.0),
                "grid_steps": kernels.get("grid_steps", 0), "step_cost_us": kernels.get("step_cost_us", 0.0),
                "xla_ragged_dot_us": v["xla_ragged_dot_us"], "xla_ops_us": v["xla_ops"]["us"],
                "xla_op_count": v["xla_ops"]["count"], "hbm_bytes": v["hbm_bytes"],
                "bytes_over_min": v["bytes_over_min"], "over_roofline": v["over_roofline"],
                "mxu_pct": v["mxu_utilisation_pct"],
            })
            for key in ("tiling", "standalone_best_tiling", "bytes_over_quantized_min"):
                if key in v:
                    line[key] = v[key]
            if v.get("refused_tilings"):
                line["refused_tilings"] = len(v["refused_tilings"])
            lines.append(_round(line))
    return lines


def dump_compact(value, indent: int = 0) -> str:
    """JSON with sorted keys where a list of objects holds one object per line (reviewable diffs)."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f'{pad} {json.dumps(k)}: {dump_compact(v, indent + 1)}' for k, v in sorted(value.items())]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        items = [f"{pad} {json.dumps(v, sort_keys=True)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value, sort_keys=True)


def method(args) -> dict:
    return {
        "model": "tpu_kernels.perf.xla_program.model_program: Pallas kernels by tpu_kernels.perf grid replay, XLA's "
                 "ragged-dot loops by tpu_kernels.perf.xla_ragged_dot, other XLA ops from the optimized HLO's placement "
                 "(HBM bytes at HBM bandwidth, VMEM bytes at 22x it)",
        "headline": "us: the calibrated pipelined figure at peak HBM bandwidth (grid step "
                    + ", ".join(f"{g} {grid_step_s(g) * 1e6:.2f} us" for g in GENERATIONS)
                    + "; v6e has no measurements and takes v5e's constants)",
        "bands": "band_p90_us / band_median_us: the Pallas kernels' time at the Pallas ragged-dot error and XLA's "
                 "ragged-dot loops at theirs (benchmarks/results/calibration.json); uncalibrated_us (other XLA ops) "
                 "carries no band",
        "calibrated_errors": calibration_bands.bands_used(GENERATIONS, ("pallas_ragged_dot", "xla_ragged_dot")),
        "also": "overlap_us: each kernel's MXU work fully overlapping its copies (the headline before calibration); "
                "hbm85_us: the headline at 85 % of peak HBM bandwidth",
        "roofline": "max(min_bytes / peak HBM bandwidth, useful FLOPs / bf16 peak); min_bytes = rows in + "
                    "routing + each active expert's weights and biases once + rows out",
        "routing": f"Dirichlet({POPULARITY_CONCENTRATION}) popularity, Gumbel-top-k, seed {SEED}; EP: busiest rank",
        "ours": f"{args.repo.name}: {LAYER_ENTRY} of the built kernel, compiled with its kernel bodies",
        "rivals": "megablox gmm and tokamax 0.0.12 pallas_mosaic_tpu_kernel.gmm at the best searched config "
                  "(candidate_tilings) per projection and generation, XLA lax.ragged_dot; all inside user_layer, "
                  "compiled with empty kernel bodies (lower_program(kernel_bodies=False))",
        "extra_rows": "tokamax_default: tokamax's kernel at tokamax's own untuned pick; ours_int8 / ours_fp8 at decode",
        "dtype": jnp.dtype(DTYPE).name,
        "raw": "benchmarks/results/raw/moe_layer.rows.json (untracked): every term, placement and searched config",
    }


def write_outputs(args, rows: list[dict], cases: list[Case], hf: dict | None, run: dict) -> dict:
    done = {r["label"] for r in rows}
    targets = check_targets(rows)
    report = {
        "method": method(args),
        "complete": len(done) == len(cases),
        "missing_shapes": [case.label for case in cases if case.label not in done],
        "targets": _round(targets),
        "hf_257us": hf,
        "shapes": shape_lines(rows),
        "variants": variant_lines(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump_compact(report) + "\n")
    args.out.with_suffix(".md").write_text(markdown_table(rows))
    raw = args.raw_dir
    raw.mkdir(parents=True, exist_ok=True)
    (raw / f"{args.out.stem}.rows.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    (raw / f"{args.out.stem}.run.json").write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    if not args.no_plot and rows:
        plot(rows, args.out.with_suffix(".png"))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=DEFAULT_REPO, help="kernel repo whose layer entry is ours")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--raw-dir", type=Path, default=RAW_DIR, help="raw rows and the run's facts (untracked)")
    parser.add_argument("--settings", nargs="*", default=None, help="setting labels (default: all)")
    parser.add_argument("--tokens", nargs="*", type=int, default=list(DECODE_TOKENS + PREFILL_TOKENS))
    parser.add_argument("--rivals", nargs="*", default=list(RIVALS), choices=list(RIVALS))
    parser.add_argument("--jobs", type=int, default=2, help="compiles run in parallel (threads)")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--no-cache", action="store_true", help="recompute every compile and replay")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--retarget", action="store_true",
                        help="only recompute the summary, targets, table and plot from the raw rows of the last run")
    args = parser.parse_args(argv)
    settings = [s for s in SETTINGS if args.settings is None or s.label in args.settings]
    if not settings:
        parser.error(f"no setting matches {args.settings}; known: {[s.label for s in SETTINGS]}")
    cases = sorted(make_cases(settings, args.tokens), key=priority)
    cache = Cache(None if args.no_cache else args.cache_dir)
    if not args.retarget:
        require_kernel_repo(args.repo)
    if args.retarget:
        rows = json.loads((args.raw_dir / f"{args.out.stem}.rows.json").read_text())
        for row in rows:
            summarise(row, args.rivals)
        previous = json.loads(args.out.read_text()) if args.out.is_file() else {}
        hf = hf_case(rows, cache) if "tokamax" in args.rivals else previous.get("hf_257us")
        run = json.loads((args.raw_dir / f"{args.out.stem}.run.json").read_text())
        write_outputs(args, rows, cases, hf, run)
        return 0

    started = time.perf_counter()
    load_at_start = os.getloadavg()
    compiler = Compiler(cache, args.jobs)

    def run_facts() -> dict:
        return {"python": platform.python_version(), "versions": cache.versions,
                "cache": {"hits": cache.hits, "misses": cache.misses}, "cpus": os.cpu_count(), "jobs": args.jobs,
                "load_average_1_5_15_min": {"start": load_at_start, "end": os.getloadavg()},
                "seconds_by_phase": {phase: round(t, 1) for phase, t in CLOCK.seconds.items()},
                "seconds": round(time.perf_counter() - started, 1)}

    rows = []
    report = None
    with build_folder(None if args.no_cache else args.cache_dir) as build_dir:
        built = load_kernel(args.repo, build_dir)
        queued: list = []
        upcoming = iter(cases)
        while True:
            for case in upcoming:
                queued.append(measure_case(built, case, cache, compiler, args.rivals))
                print(f"queued {case.label:48s} rows={case.rows:5d} picks={case.picks:6d} live={case.live_picks:6d} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
                if len(queued) > LOOKAHEAD:
                    break
            if not queued:
                break
            for row in queued.pop(0)():
                rows.append(row)
                ours = row["variants"].get("ours", {})
                print(f"{row['label']:48s} {row['generation']}  ours {ours.get('headline_us', float('nan')):10.1f} us"
                      f"  best rival {row.get('best_rival')} {row.get('best_rival_us', float('nan')):10.1f} us"
                      f"  roofline {row['roofline_us']:10.1f} us  ({time.perf_counter() - started:.0f} s)", flush=True)
            report = write_outputs(args, rows, cases, None, run_facts())
        hf = hf_case(rows, cache) if "tokamax" in args.rivals else None
        report = write_outputs(args, rows, cases, hf, run_facts())
    compiler.pool.shutdown()
    targets = report["targets"]
    anchor = targets["anchor"][" ".join(map(str, ANCHOR))]
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s (cache hits {cache.hits}, misses "
          f"{cache.misses}); anchor {anchor['ours_us']} us (p90 band {anchor['ours_band_p90_us']}, target "
          f"{ANCHOR_TARGET_US}); decode within {DECODE_MAX_OVER_ROOFLINE}x: {targets['decode_meets']}/"
          f"{targets['decode_shapes']}; shapes a rival wins: {len(targets['rival_wins'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
