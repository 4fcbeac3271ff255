"""ragged_dot: our kernel vs megablox `gmm` (default tiling) vs tokamax's Pallas TPU ragged_dot, for MoE layers.

No TPU is needed for the default mode. For every shape (one projection of one
MoE experts layer, realistic routing) and each of v5e and v6e this

- replays each kernel's grid with `tpu_kernels.perf.model_pallas_traffic`
  (HBM bytes its BlockSpecs move, MXU work on its block shapes, grid steps)
  and models its time with `perf.roofline`: the aggregate estimate
  max(bytes / HBM bandwidth, MXU FLOPs / peak) + 0.35 us per step, and the
  step-by-step double-buffered pipeline estimate;
- compares with the roofline of the shape: reading each active expert's
  weights, the rows and writing the output once (`min_bytes`), or the useful
  FLOPs at peak, whichever takes longer;
- compiles each kernel ahead of time for the generation (libtpu compile-only
  topology) and records success and the VMEM its pipeline holds.

Kernels:
- ours: `ragged_dot_tpu.pallas_tpu.ragged_dot` with `select_config` for the
  generation (the searched table, `tile_table.py`);
- megablox: `jax.experimental.pallas.ops.tpu.megablox.gmm` at its default
  tiling (128, 128, 128);
- tokamax: `tokamax` 0.0.12's Pallas Mosaic TPU ragged_dot (`backend.gmm`) at
  the config tokamax itself picks (its autotuning cache for the device kind,
  else its `_get_heuristics_config`: a lookup table of tuned shapes, else
  (128, 128, 128) with 2 input buffers). Tokamax refuses shapes with M, K or N
  below 128 (`NotImplementedError`); those are reported as unsupported.
  Tokamax runs its grid with `pltpu.emit_pipeline` inside a grid-less kernel
  whose operands stay in HBM, which the traffic model cannot see; the model
  replays the same grid, BlockSpecs and body as a plain `pallas_call` (same
  copy rules), while the AOT compile uses tokamax's own code path.

Routing: per layer, expert popularity ~ Dirichlet(8) (seeded), each token
picks top_k distinct experts by Gumbel-top-k over log popularity. For an
expert-parallel rank, the rows are the picks landing on that rank's experts;
we take the busiest rank (it sets the layer's latency).

Usage:
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/ragged_dot.py [--out benchmarks/results/ragged_dot.json]
        [--no-compile] [--no-plot]
    python benchmarks/ragged_dot.py --device tpu [--out ragged_dot_tpu.json] [--iterations 50]
        (on a TPU VM: wall-clock of every kernel with block_until_ready, same shapes)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KERNEL_REPO = ROOT / "kernel_repos" / "ragged-dot-tpu"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ragged_dot.json"
GENERATIONS = ("v5e", "v6e")
DTYPE = jnp.bfloat16
BENCH_SEED = 0
POPULARITY_CONCENTRATION = 8.0
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS = (2048, 8192)
MEGABLOX_TILING = (128, 128, 128)
TOKAMAX_DEVICE_KINDS = {"v5e": "TPU v5 lite", "v6e": "TPU v6 lite"}
TOKAMAX_MIN_DIM = 128
DECODE_TARGET_ROOFLINE_RATIO = 1.15
PREFILL_TARGET_MXU_PCT = 80.0
# The published anchor: one Qwen3-30B-A3B experts layer on one EP8 rank of a v6e at 256 tokens.
EP8_256_TARGET_MS = 0.106
KERNELS = ("ours", "megablox", "tokamax")


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    # transformers stores experts as [E, out, in] (rhs transposed) except GPT-OSS: [E, in, out].
    weights_in_out: bool = False


MODELS = {
    "qwen3-30b-a3b": Model("qwen3-30b-a3b", hidden=2048, intermediate=768, experts=128, top_k=8),
    "gemma-4-26b-a4b": Model("gemma-4-26b-a4b", hidden=2816, intermediate=704, experts=128, top_k=8),
    "gpt-oss-120b": Model("gpt-oss-120b", hidden=2880, intermediate=2880, experts=128, top_k=4, weights_in_out=True),
    "deepseek-v3": Model("deepseek-v3", hidden=7168, intermediate=2048, experts=256, top_k=8),
}

# (setting label, model, expert-parallel ranks). DeepSeek-V3 runs EP32 here: 8 experts per rank.
SETTINGS = (
    ("qwen3-30b-a3b", "qwen3-30b-a3b", 1),
    ("qwen3-30b-a3b EP8", "qwen3-30b-a3b", 8),
    ("gemma-4-26b-a4b", "gemma-4-26b-a4b", 1),
    ("gpt-oss-120b", "gpt-oss-120b", 1),
    ("deepseek-v3 EP32", "deepseek-v3", 32),
)


@dataclasses.dataclass(frozen=True)
class Shape:
    setting: str
    model: Model
    ep: int
    tokens: int
    projection: str  # "gate_up" | "down"
    k: int
    n: int
    group_sizes: tuple[int, ...]

    @property
    def phase(self) -> str:
        return "decode" if self.tokens in DECODE_TOKENS else "prefill"

    @property
    def m(self) -> int:
        return max(sum(self.group_sizes), 1)

    @property
    def groups(self) -> int:
        return len(self.group_sizes)

    @property
    def active_groups(self) -> int:
        return sum(1 for size in self.group_sizes if size)

    @property
    def transpose_rhs(self) -> bool:
        return not self.model.weights_in_out

    @property
    def label(self) -> str:
        return f"{self.setting} T={self.tokens} {self.projection}"

    def avals(self, rows: int | None = None) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """lhs and rhs; `rows` pads lhs for kernels that need M to be a multiple of their row tile."""
        rhs = (self.groups, self.n, self.k) if self.transpose_rhs else (self.groups, self.k, self.n)
        return jax.ShapeDtypeStruct((rows or self.m, self.k), DTYPE), jax.ShapeDtypeStruct(rhs, DTYPE)

    def sizes_array(self) -> np.ndarray:
        return np.asarray(self.group_sizes, np.int32)

    @property
    def min_bytes(self) -> int:
        itemsize = jnp.dtype(DTYPE).itemsize
        return (self.active_groups * self.k * self.n + self.m * self.k + self.m * self.n) * itemsize

    @property
    def useful_flops(self) -> int:
        return 2 * sum(self.group_sizes) * self.k * self.n


def rank_group_sizes(model: Model, ep: int, tokens: int, seed: int) -> np.ndarray:
    """Rows per expert on the busiest of `ep` ranks for `tokens` routed tokens."""
    rng = np.random.default_rng([seed, tokens, model.experts, model.top_k])
    popularity = rng.dirichlet(np.full(model.experts, POPULARITY_CONCENTRATION))
    scores = np.log(popularity) + rng.gumbel(size=(tokens, model.experts))
    picks = np.argpartition(-scores, model.top_k - 1, axis=1)[:, : model.top_k]
    per_expert = np.bincount(picks.ravel(), minlength=model.experts).reshape(ep, -1)
    return per_expert[np.argmax(per_expert.sum(axis=1))].astype(np.int32)


def projections(model: Model) -> tuple[tuple[str, int, int], ...]:
    """(name, K, N) of the two grouped matmuls of a gated experts layer."""
    return ("gate_up", model.hidden, 2 * model.intermediate), ("down", model.intermediate, model.hidden)


def make_shapes(settings=SETTINGS, tokens_list=DECODE_TOKENS + PREFILL_TOKENS, seed: int = BENCH_SEED) -> list[Shape]:
    shapes = []
    for setting, model_name, ep in settings:
        model = MODELS[model_name]
        for tokens in tokens_list:
            sizes = tuple(int(s) for s in rank_group_sizes(model, ep, tokens, seed))
            for projection, k, n in projections(model):
                shapes.append(Shape(setting, model, ep, tokens, projection, k, n, sizes))
    return shapes


def load_our_kernel(build_dir: Path):
    import kernels

    from tpu_kernels.builder import build_kernel_repo

    return kernels.get_local_kernel(build_kernel_repo(KERNEL_REPO, build_dir), backend="cpu")


# ----------------------------------------------------------------------------- the three kernels


def ours_config(built, shape: Shape, generation: str):
    return built.config.select_config(
        shape.m, shape.k, shape.n, DTYPE, generation=generation, num_groups=shape.groups
    )


def ours_fn(built, shape: Shape, generation: str):
    config = ours_config(built, shape, generation)
    return functools.partial(built.pallas_tpu.ragged_dot, transpose_rhs=shape.transpose_rhs, config=config), config


def megablox_fn(shape: Shape):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    return functools.partial(
        gmm, preferred_element_type=DTYPE, tiling=MEGABLOX_TILING, transpose_rhs=shape.transpose_rhs
    )


def tokamax_unsupported(shape: Shape) -> str | None:
    small = [f"{name}={value}" for name, value in (("M", shape.m), ("K", shape.k), ("N", shape.n)) if value < TOKAMAX_MIN_DIM]
    if small:
        return f"tokamax's Pallas TPU ragged_dot needs M, K, N >= {TOKAMAX_MIN_DIM} (NotImplementedError); here " + ", ".join(small)
    return None


def tokamax_config(shape: Shape, generation: str) -> tuple[dict, str]:
    """The config tokamax picks for this call on `generation`, and where it came from."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu

    op = tokamax_tpu.PallasMosaicTpuRaggedDot()
    dims = tokamax_tpu.DLHS_RAGGED_DOT_DIM_NUMS if shape.transpose_rhs else tokamax_tpu.DEFAULT_RAGGED_DOT_DIM_NUMS
    lhs, rhs = shape.avals()
    bound = op.bind(lhs, rhs, group_sizes=jnp.asarray(shape.sizes_array()), ragged_dot_dimension_numbers=dims)
    cached = op.get_autotuning_cache(TOKAMAX_DEVICE_KINDS[generation]).get(bound.autotuning_cache_key)
    if cached is not None and cached.items():
        config, source = cached.fastest_config, f"autotuning cache ({TOKAMAX_DEVICE_KINDS[generation]})"
    else:
        config = bound.heuristics_config
        lut = tokamax_tpu.GMM_RHS_TRANSPOSE_TILING_TUNED_LUT if shape.transpose_rhs else tokamax_tpu.GMM_TILING_TUNED_LUT
        tuned = any(config == tokamax_tpu.Config(tile_m=t[0], tile_k=t[1], tile_n=t[2], input_buffer_count=b)
                    for t, b in lut.values())
        source = "heuristics: tuned lookup table" if tuned else "heuristics: default (no tuned entry)"
    fields = dict(tile_m=config.tile_m, tile_k=config.tile_k, tile_n=config.tile_n,
                  input_buffer_count=config.input_buffer_count)
    return fields, source


def tokamax_fn(shape: Shape, config: dict):
    from jax import lax
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu_kernel as tokamax_kernel

    return functools.partial(
        tokamax_kernel.gmm,
        precision=(lax.Precision.DEFAULT, lax.Precision.DEFAULT),
        out_dtype=DTYPE,
        tiling=(config["tile_m"], config["tile_k"], config["tile_n"]),
        input_buffer_count=config["input_buffer_count"],
        transpose_rhs=shape.transpose_rhs,
    )


@contextlib.contextmanager
def tokamax_grid_as_pallas_call():
    """Runs tokamax's emit_pipeline grid as a plain pallas_call with the same grid, BlockSpecs and body.

    The traffic model replays a pallas_call's grid; tokamax hides its grid in
    an emit_pipeline inside a grid-less kernel with HBM operands. Buffer
    counts other than 2 become `pl.Buffered(n)`, as tokamax does.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu_kernel as tokamax_kernel

    def plain_pallas_call(kernel, out_shape, grid_spec, compiler_params, input_buffer_count=None, **kw):
        counts = input_buffer_count or [2] * len(grid_spec.in_specs)
        if any(count != 2 for count in counts):
            grid_spec = pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=grid_spec.num_scalar_prefetch,
                grid=grid_spec.grid,
                in_specs=[
                    spec if count == 2 else dataclasses.replace(spec, pipeline_mode=pl.Buffered(count))
                    for spec, count in zip(grid_spec.in_specs, counts)
                ],
                out_specs=grid_spec.out_specs,
                scratch_shapes=grid_spec.scratch_shapes,
            )
        kw.pop("metadata", None)
        kw.pop("interpret", None)
        return pl.pallas_call(kernel, out_shape, grid_spec=grid_spec, compiler_params=compiler_params, **kw)

    original = tokamax_kernel.common.custom_buffered_pallas_call
    tokamax_kernel.common.custom_buffered_pallas_call = plain_pallas_call
    try:
        yield
    finally:
        tokamax_kernel.common.custom_buffered_pallas_call = original


# ----------------------------------------------------------------------------- modelling


def padded_rows(m: int, tile_m: int) -> int:
    """megablox and tokamax raise unless M is a multiple of tile_m; callers pad lhs (pad rows in no group)."""
    return -(-m // tile_m) * tile_m


def model_kernel(fn, shape: Shape, generations, rows: int | None = None) -> dict:
    from tpu_kernels import perf

    lhs, rhs = shape.avals(rows)
    calls = perf.model_pallas_traffic(fn, lhs, rhs, shape.sizes_array())
    results = {}
    for generation in generations:
        modelled = perf.roofline(calls, generation, min_bytes=shape.min_bytes, min_flops=shape.useful_flops)
        peak = perf.tpu_generation(generation).bf16_flops_per_s
        results[generation] = {
            "modelled_time_us": modelled.time_s * 1e6,
            "modelled_pipelined_time_us": modelled.pipelined_time_s * 1e6,
            "roofline_us": modelled.roofline_s * 1e6,
            "pct_of_roofline": modelled.pct_of_roofline,
            "pipelined_pct_of_roofline": modelled.pipelined_pct_of_roofline,
            "mxu_utilisation_pct": 100.0 * shape.useful_flops / peak / modelled.time_s,
            "bound": modelled.bound,
            "hbm_bytes": modelled.hbm_bytes,
            "bytes_over_min": modelled.hbm_bytes / shape.min_bytes,
            "mxu_flops": modelled.mxu_flops,
            "flops_over_useful": modelled.mxu_flops / max(shape.useful_flops, 1),
            "grid_steps": modelled.steps,
            "overhead_us": modelled.overhead_s * 1e6,
            "vmem_bytes": modelled.vmem_bytes,
            "fits_vmem": modelled.fits_vmem,
        }
    return results


def compile_kernel(fn, shape: Shape, generation: str, rows: int | None = None) -> dict:
    from tpu_kernels.aot import compile_for

    lhs, rhs = shape.avals(rows)
    avals = [lhs, rhs, jax.ShapeDtypeStruct((shape.groups,), jnp.int32)]
    start = time.perf_counter()
    try:
        compile_for(fn, avals, generation)
    except Exception as error:  # noqa: BLE001 - a failed compile is a result
        lines = str(error).strip().splitlines()
        return {"compiled": False, "seconds": time.perf_counter() - start, "error": lines[0] if lines else repr(error)}
    return {"compiled": True, "seconds": time.perf_counter() - start}


def measure_shape(built, shape: Shape, compile_targets: bool) -> dict:
    entry = {
        "label": shape.label,
        "setting": shape.setting,
        "model": shape.model.name,
        "ep_ranks": shape.ep,
        "tokens": shape.tokens,
        "phase": shape.phase,
        "projection": shape.projection,
        "m": shape.m,
        "k": shape.k,
        "n": shape.n,
        "groups": shape.groups,
        "active_groups": shape.active_groups,
        "max_group_rows": max(shape.group_sizes),
        "transpose_rhs": shape.transpose_rhs,
        "min_bytes": shape.min_bytes,
        "useful_flops": shape.useful_flops,
        "kernels": {},
    }
    kernels_entry = entry["kernels"]

    ours = {"per_generation": {}}
    for generation in GENERATIONS:
        fn, config = ours_fn(built, shape, generation)
        result = model_kernel(fn, shape, [generation])[generation]
        result["config"] = config._asdict()
        result["vmem_limit_bytes"] = built.config.vmem_limit(config, shape.m, shape.k, shape.n, DTYPE)
        if compile_targets:
            result["aot"] = compile_kernel(fn, shape, generation)
        ours["per_generation"][generation] = result
    kernels_entry["ours"] = ours

    fn = megablox_fn(shape)
    rows = padded_rows(shape.m, MEGABLOX_TILING[0])
    megablox = {"config": dict(zip(("tile_m", "tile_k", "tile_n"), MEGABLOX_TILING)), "lhs_rows": rows,
                "per_generation": model_kernel(fn, shape, GENERATIONS, rows)}
    if compile_targets:
        for generation in GENERATIONS:
            megablox["per_generation"][generation]["aot"] = compile_kernel(fn, shape, generation, rows)
    kernels_entry["megablox"] = megablox

    reason = tokamax_unsupported(shape)
    if reason:
        kernels_entry["tokamax"] = {"supported": False, "reason": reason}
    else:
        tokamax = {"supported": True, "per_generation": {}}
        modelled_by_config: dict[tuple, dict] = {}
        for generation in GENERATIONS:
            config, source = tokamax_config(shape, generation)
            rows = padded_rows(shape.m, config["tile_m"])
            key = tuple(config.values())
            if key not in modelled_by_config:
                with tokamax_grid_as_pallas_call():
                    modelled_by_config[key] = model_kernel(tokamax_fn(shape, config), shape, GENERATIONS, rows)
            result = dict(modelled_by_config[key][generation])
            result["config"] = config
            result["config_source"] = source
            result["lhs_rows"] = rows
            if compile_targets:
                result["aot"] = compile_kernel(tokamax_fn(shape, config), shape, generation, rows)
            tokamax["per_generation"][generation] = result
        kernels_entry["tokamax"] = tokamax
    return entry


def kernel_result(entry: dict, kernel: str, generation: str) -> dict | None:
    data = entry["kernels"][kernel]
    if not data.get("supported", True):
        return None
    return data["per_generation"][generation]


def explain_loss(entry: dict, generation: str, rival: str) -> str:
    """Why the model puts a rival ahead of us on this shape, from the two breakdowns."""
    ours, other = kernel_result(entry, "ours", generation), kernel_result(entry, rival, generation)
    reasons = []
    if ours["hbm_bytes"] > other["hbm_bytes"]:
        reasons.append(f"ours moves {ours['hbm_bytes'] / 1e6:.2f} MB vs {other['hbm_bytes'] / 1e6:.2f} MB")
    if ours["mxu_flops"] > other["mxu_flops"]:
        reasons.append(f"ours spends {ours['mxu_flops'] / 1e9:.2f} vs {other['mxu_flops'] / 1e9:.2f} GFLOP on the MXU")
    if ours["grid_steps"] > other["grid_steps"]:
        reasons.append(f"ours runs {ours['grid_steps']} grid steps vs {other['grid_steps']}")
    return "; ".join(reasons) or "equal breakdowns; rounding"


def compare(results: list[dict]) -> list[dict]:
    """Shapes where megablox or tokamax models faster than ours, with the model's reason."""
    losses = []
    for entry in results:
        for generation in GENERATIONS:
            ours = kernel_result(entry, "ours", generation)
            for rival in ("megablox", "tokamax"):
                other = kernel_result(entry, rival, generation)
                if other is None:
                    continue
                for metric in ("modelled_time_us", "modelled_pipelined_time_us"):
                    if ours[metric] > other[metric] * 1.0001:
                        losses.append({
                            "label": entry["label"], "generation": generation, "rival": rival, "metric": metric,
                            "ours_us": ours[metric], "rival_us": other[metric],
                            "why": explain_loss(entry, generation, rival),
                        })
    return losses


def layers(results: list[dict]) -> list[dict]:
    """Both projections of one experts layer (gate_up then down) summed per kernel and generation."""
    by_layer: dict[tuple, list[dict]] = {}
    for entry in results:
        by_layer.setdefault((entry["setting"], entry["tokens"]), []).append(entry)
    summary = []
    for (setting, tokens), entries in by_layer.items():
        layer = {"setting": setting, "tokens": tokens, "phase": entries[0]["phase"],
                 "m": entries[0]["m"], "active_groups": entries[0]["active_groups"], "per_generation": {}}
        for generation in GENERATIONS:
            roofline = sum(kernel_result(e, "ours", generation)["roofline_us"] for e in entries)
            hbm_roofline = sum(e["min_bytes"] for e in entries) / _hbm_bytes_per_s(generation) * 1e6
            row = {"roofline_us": roofline, "hbm_roofline_us": hbm_roofline}
            for kernel in KERNELS:
                parts = [kernel_result(e, kernel, generation) for e in entries]
                if any(p is None for p in parts):
                    row[kernel] = None
                    continue
                time_us = sum(p["modelled_time_us"] for p in parts)
                pipelined_us = sum(p["modelled_pipelined_time_us"] for p in parts)
                row[kernel] = {
                    "modelled_time_us": time_us,
                    "modelled_pipelined_time_us": pipelined_us,
                    "pct_of_roofline": 100.0 * roofline / time_us,
                    "pipelined_pct_of_roofline": 100.0 * roofline / pipelined_us,
                    "mxu_utilisation_pct": 100.0 * sum(e["useful_flops"] for e in entries)
                    / _bf16_flops_per_s(generation) / (time_us * 1e-6),
                }
            layer["per_generation"][generation] = row
        summary.append(layer)
    return summary


def _hbm_bytes_per_s(generation: str) -> float:
    from tpu_kernels import perf

    return perf.tpu_generation(generation).hbm_bytes_per_s


def _bf16_flops_per_s(generation: str) -> float:
    from tpu_kernels import perf

    return perf.tpu_generation(generation).bf16_flops_per_s


def check_targets(results: list[dict], layer_rows: list[dict]) -> dict:
    """The issue's targets, checked on the modelled v6e times (and reported for v5e)."""
    decode, prefill = [], []
    for entry in results:
        for generation in GENERATIONS:
            ours = kernel_result(entry, "ours", generation)
            hbm_roofline_us = entry["min_bytes"] / _hbm_bytes_per_s(generation) * 1e6
            row = {"label": entry["label"], "generation": generation}
            if entry["phase"] == "decode":
                row["time_over_hbm_roofline"] = ours["modelled_time_us"] / hbm_roofline_us
                row["pipelined_over_hbm_roofline"] = ours["modelled_pipelined_time_us"] / hbm_roofline_us
                row["meets"] = row["time_over_hbm_roofline"] <= DECODE_TARGET_ROOFLINE_RATIO
                decode.append(row)
            else:
                row["mxu_utilisation_pct"] = ours["mxu_utilisation_pct"]
                row["pct_of_roofline"] = ours["pct_of_roofline"]
                row["bound"] = ours["bound"]
                # An HBM-bound shape cannot keep the MXU 80 % busy; its ceiling is the roofline's.
                row["mxu_ceiling_pct"] = (
                    100.0 * entry["useful_flops"] / _bf16_flops_per_s(generation) / (ours["roofline_us"] * 1e-6)
                )
                row["meets"] = row["mxu_utilisation_pct"] >= PREFILL_TARGET_MXU_PCT
                row["meets_pct_of_roofline"] = row["pct_of_roofline"] >= PREFILL_TARGET_MXU_PCT
                prefill.append(row)
    anchor = next(
        (layer for layer in layer_rows if layer["setting"] == "qwen3-30b-a3b EP8" and layer["tokens"] == 256), None
    )
    anchor_ms = None if anchor is None else anchor["per_generation"]["v6e"]["ours"]["modelled_time_us"] / 1e3
    return {
        "decode_time_over_hbm_roofline_max": DECODE_TARGET_ROOFLINE_RATIO,
        "prefill_mxu_utilisation_min_pct": PREFILL_TARGET_MXU_PCT,
        "ep8_256_tokens_layer_v6e_ms": anchor_ms,
        "ep8_256_tokens_layer_target_ms": EP8_256_TARGET_MS,
        "ep8_256_tokens_meets": anchor_ms is not None and anchor_ms <= EP8_256_TARGET_MS,
        "decode": decode,
        "prefill": prefill,
    }


# ----------------------------------------------------------------------------- plot


def plot(layer_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "#1b7837", "megablox": "#762a83", "tokamax": "#e08214"}
    fig, axes = plt.subplots(len(GENERATIONS), 1, figsize=(20, 5.5 * len(GENERATIONS)), sharex=True)
    labels = [f"{row['setting']}\nT={row['tokens']}" for row in layer_rows]
    x = np.arange(len(layer_rows))
    width = 0.27
    for ax, generation in zip(axes, GENERATIONS):
        for offset, kernel in zip((-width, 0.0, width), KERNELS):
            values = [
                row["per_generation"][generation][kernel]["pct_of_roofline"]
                if row["per_generation"][generation][kernel] else 0.0
                for row in layer_rows
            ]
            bars = ax.bar(x + offset, values, width, color=colors[kernel], label=kernel)
            for bar, row in zip(bars, layer_rows):
                if row["per_generation"][generation][kernel] is None:
                    ax.text(bar.get_x() + bar.get_width() / 2, 1.5, "n/a", rotation=90, ha="center", va="bottom",
                            fontsize=7, color=colors[kernel])
        ax.axhline(100.0 / DECODE_TARGET_ROOFLINE_RATIO, color="grey", linestyle="--", linewidth=0.8)
        ax.set_ylim(0, 105)
        ax.set_ylabel(f"{generation}: modelled % of roofline")
        ax.set_title(f"{generation}: one experts layer (gate_up + down), % of roofline (dashed: 1/1.15)")
        ax.legend(loc="upper right", ncols=3)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(x, labels, rotation=90, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- real TPU


def tpu_generation_of(device) -> str:
    kind = device.device_kind.lower()
    if "v5 lite" in kind or "v5e" in kind:
        return "v5e"
    if "v6" in kind:
        return "v6e"
    return kind.replace(" ", "_")


def time_on_device(fn, args, iterations: int) -> dict:
    """Wall-clock of a jitted call: median single-call latency, and the mean of back-to-back calls."""
    jitted = jax.jit(fn)
    jitted(*args).block_until_ready()
    jitted(*args).block_until_ready()
    latencies = []
    for _ in range(iterations):
        start = time.perf_counter()
        jitted(*args).block_until_ready()
        latencies.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(iterations):
        out = jitted(*args)
    out.block_until_ready()
    back_to_back = (time.perf_counter() - start) / iterations
    return {"median_latency_us": float(np.median(latencies) * 1e6), "back_to_back_us": back_to_back * 1e6}


def run_on_tpu(built, shapes: list[Shape], iterations: int) -> dict:
    from jax import lax

    import tokamax

    device = jax.devices()[0]
    generation = tpu_generation_of(device)
    rng = np.random.default_rng(BENCH_SEED)
    rows = []
    for shape in shapes:
        lhs_aval, rhs_aval = shape.avals()
        lhs = jax.device_put(jnp.asarray(rng.standard_normal(lhs_aval.shape, np.float32), DTYPE), device)
        rhs = jax.device_put(
            jnp.asarray(rng.standard_normal(rhs_aval.shape, np.float32) * 0.02, DTYPE), device
        )
        sizes = jax.device_put(jnp.asarray(shape.sizes_array()), device)
        row = {"label": shape.label, "m": shape.m, "k": shape.k, "n": shape.n, "groups": shape.groups,
               "min_bytes": shape.min_bytes, "useful_flops": shape.useful_flops, "kernels": {}}
        config = built.config.select_config(
            shape.m, shape.k, shape.n, DTYPE, generation=generation if generation in GENERATIONS else None,
            num_groups=shape.groups,
        )
        ours = functools.partial(built.pallas_tpu.ragged_dot, transpose_rhs=shape.transpose_rhs, config=config)
        row["kernels"]["ours"] = {"config": config._asdict(), **time_on_device(ours, (lhs, rhs, sizes), iterations)}
        row["kernels"]["megablox"] = time_on_device(megablox_fn(shape), (lhs, rhs, sizes), iterations)
        dims = lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (2 if shape.transpose_rhs else 1,)), ((), ())),
            lhs_ragged_dimensions=(0,),
            rhs_group_dimensions=(0,),
        )

        def tokamax_call(lhs, rhs, sizes, dims=dims):
            return tokamax.ragged_dot_general(
                lhs, rhs, sizes, ragged_dot_dimension_numbers=dims, implementation="mosaic"
            )

        try:
            row["kernels"]["tokamax"] = time_on_device(tokamax_call, (lhs, rhs, sizes), iterations)
        except NotImplementedError as error:
            row["kernels"]["tokamax"] = {"supported": False, "reason": str(error)}
        hbm_s = shape.min_bytes / _hbm_bytes_per_s(generation) if generation in GENERATIONS else None
        for result in row["kernels"].values():
            if hbm_s and "back_to_back_us" in result:
                result["pct_of_hbm_roofline"] = 100.0 * hbm_s * 1e6 / result["back_to_back_us"]
        rows.append(row)
        print(f"{shape.label:45s} " + "  ".join(
            f"{name}={result.get('back_to_back_us', float('nan')):8.1f}us" for name, result in row["kernels"].items()
        ), flush=True)
        del lhs, rhs
    return {"device": device.device_kind, "generation": generation, "iterations": iterations, "shapes": rows}


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=("model", "tpu"), default="model",
                        help="model: traffic model + AOT compile on any machine; tpu: wall-clock on this TPU")
    parser.add_argument("--no-compile", action="store_true", help="skip the ahead-of-time compiles")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--iterations", type=int, default=50, help="timed calls per kernel and shape (--device tpu)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    shapes = make_shapes()
    with tempfile.TemporaryDirectory() as build_dir:
        built = load_our_kernel(Path(build_dir))
        if args.device == "tpu":
            out = args.out or ROOT / "benchmarks" / "results" / "ragged_dot_tpu.json"
            report = run_on_tpu(built, shapes, args.iterations)
            report["seconds"] = time.perf_counter() - started
            out.write_text(json.dumps(report, indent=1) + "\n")
            print(f"wrote {out}")
            return 0
        results = []
        for shape in shapes:
            entry = measure_shape(built, shape, compile_targets=not args.no_compile)
            results.append(entry)
            cells = []
            for generation in GENERATIONS:
                for kernel in KERNELS:
                    result = kernel_result(entry, kernel, generation)
                    cells.append(f"{generation} {kernel} " + ("  n/a " if result is None else f"{result['pct_of_roofline']:5.1f}%"))
            print(f"{shape.label:40s} M={shape.m:6d} " + " | ".join(cells), flush=True)

    layer_rows = layers(results)
    compile_failures = [
        f"{entry['label']} {kernel} {generation}: {result['aot']['error']}"
        for entry in results
        for generation in GENERATIONS
        for kernel in KERNELS
        if (result := kernel_result(entry, kernel, generation)) is not None
        and "aot" in result and not result["aot"]["compiled"]
    ]
    report = {
        "method": {
            "model": "tpu_kernels.perf grid replay: time = max(HBM bytes / bandwidth, MXU FLOPs / peak) + 0.35 us "
                     "x grid steps; pipelined = step-by-step double-buffered estimate",
            "roofline": "max(min_bytes / HBM bandwidth, useful FLOPs / bf16 peak); min_bytes = each active "
                        "expert's weights + lhs rows + output rows, once",
            "routing": f"expert popularity ~ Dirichlet({POPULARITY_CONCENTRATION}), Gumbel-top-k picks per token, "
                       f"seed {BENCH_SEED}; EP settings: the busiest rank's picks",
            "dtype": jnp.dtype(DTYPE).name,
            "kernels": {
                "ours": "ragged_dot_tpu.pallas_tpu.ragged_dot, select_config(generation) (searched table)",
                "megablox": f"jax.experimental.pallas.ops.tpu.megablox.gmm, tiling {MEGABLOX_TILING} (its default)",
                "tokamax": "tokamax 0.0.12 pallas_mosaic_tpu_kernel.gmm at tokamax's own config choice; its "
                           "emit_pipeline grid replayed as a plain pallas_call",
            },
            "deepseek_v3": "EP32: 256 experts / 32 ranks = 8 experts per rank, top-8",
        },
        "environment": {"jax": jax.__version__, "python": platform.python_version()},
        "shapes": results,
        "layers": layer_rows,
        "targets": check_targets(results, layer_rows),
        "ours_slower_than_a_rival": compare(results),
        "compile_failures": compile_failures,
        "seconds": None,
    }
    out = args.out or DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.no_plot:
        plot(layer_rows, out.with_suffix(".png"))
    report["seconds"] = time.perf_counter() - started
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out} in {report['seconds']:.0f} s; compile failures: {len(compile_failures)}; "
          f"shapes where a rival models faster: {len(report['ours_slower_than_a_rival'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
