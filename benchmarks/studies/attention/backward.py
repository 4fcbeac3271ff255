"""The backward kernels at training shapes: each against its own roofline, the whole backward against
the ideal one and the forward, and the tile sweep (the package docstring says how)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import perf
from benchmarks.studies import calibration_bands
from benchmarks.studies.model_shapes import ATTENTION_WINDOWS
from benchmarks.studies.relayouts import relayout_fields, relayouts
from tpu_kernels.runtime.hardware import resolve_target, tpu_generation

from .forward import (GEMMA_4_SLIDING, GENERATIONS, GPT_OSS, QWEN3, RELAYOUT_SHOWN_FROM_US, Shape, active_steps_from_prefetch, avals,
                      kernel_fn, live_lengths, program_avals, visible_key_ranges, visible_keys,
                      visible_pairs)


@dataclasses.dataclass(frozen=True)
class TrainingShape:
    """Self-attention of one training sequence batch: B x S tokens per rank."""

    label: str
    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    sinks: bool = False

    def as_shape(self) -> Shape:
        return Shape(self.label, self.batch, self.seq, self.seq, self.q_heads, self.kv_heads, self.head_dim,
                     sliding_window=self.sliding_window)


TRAINING_TOKENS = 8192
GEMMA_4_WINDOW, GPT_OSS_WINDOW = ATTENTION_WINDOWS["gemma-4-26b-a4b sliding"], ATTENTION_WINDOWS["gpt-oss-20b"]
TRAINING_SHAPES = [
    TrainingShape(f"qwen3-30b-a3b B=1 S={TRAINING_TOKENS} causal", 1, TRAINING_TOKENS, **QWEN3),
    TrainingShape(f"gemma-4-26b-a4b sliding layer B=1 S={TRAINING_TOKENS} window={GEMMA_4_WINDOW} "
                  f"D={GEMMA_4_SLIDING['head_dim']}", 1, TRAINING_TOKENS, **GEMMA_4_SLIDING,
                  sliding_window=GEMMA_4_WINDOW),
    TrainingShape(f"gpt-oss-20b B=1 S={TRAINING_TOKENS} window={GPT_OSS_WINDOW} sinks D={GPT_OSS['head_dim']}", 1,
                  TRAINING_TOKENS, **GPT_OSS, sliding_window=GPT_OSS_WINDOW, sinks=True),
]
BACKWARD_TARGET_PCT = 80.0
# Matmuls each backward kernel must run per visible (query, key) pair and head dim, x 2 FLOPs.
NECESSARY_MATMULS = {"dq": 3, "dkv": 4}
IDEAL_BACKWARD_MATMULS = 5  # dS K, P^T dO, dS^T q, and S and dP once
SWEEP_BLOCKS = {"block_q": (128, 256, 512, 1024), "block_kv": (128, 256, 512, 1024)}


def backward_fn(built, shape: TrainingShape, generation: str, config=None):
    def backward(d_out, q, key, value, out, lse, kv_lengths, sinks):
        return built.flash_backward.kernel.flash_attention_backward(
            d_out, q, key, value, out, lse, sliding_window=shape.sliding_window, kv_lengths=kv_lengths,
            sinks=sinks if shape.sinks else None, config=config, generation=generation,
        )

    return backward


def backward_args(shape: TrainingShape, dtype):
    q, key, value = avals(shape.as_shape(), dtype)
    lse = jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.seq), jnp.float32)
    lengths = np.full(shape.batch, shape.seq, np.int32)
    return (q, q, key, value, q, lse, lengths, jax.ShapeDtypeStruct((shape.q_heads,), dtype))


def backward_program_avals(shape: TrainingShape, dtype):
    """`backward_fn`'s arguments as the binding's backward op hands them over: all device arrays. The op's
    pullback takes the same ones (d_out, and the forward's residuals q, k, v, out, lse, its lengths and sinks)."""
    return [jax.ShapeDtypeStruct(np.shape(arg), arg.dtype) for arg in backward_args(shape, dtype)]


def backward_active_steps(num_outer_blocks: dict[str, int]):
    """The kernels' `pl.when`: step (b, h, outer, s) computes block lo + s of its range iff lo + s <= hi."""

    def active(name, grid_indices, prefetch):
        lo, hi = prefetch[2], prefetch[3]
        slot = grid_indices[:, 0] * num_outer_blocks[name] + grid_indices[:, 2]
        return lo[slot] + grid_indices[:, 3] <= hi[slot]

    return active


def model_backward(built, shape: TrainingShape, dtype, generation: str, config, relayout=None) -> dict:
    """Modelled dq and dk/dv calls at `config` (a BackwardConfig): per-kernel traffic, time and roofline.

    `relayout`: the probe of the backward's program as a user's call compiles it (`relayouts`); its copies are
    added to the total. None: not probed (the tile sweep, where every tile pays the same copies), said in the row.
    """
    itemsize = jnp.dtype(dtype).itemsize
    first, last = visible_key_ranges(built.reference, shape.as_shape())
    pairs = visible_pairs(first, last)
    keys = visible_keys(first, last)
    q_bytes = shape.batch * shape.q_heads * shape.seq * shape.head_dim * itemsize
    kv_bytes = 2 * shape.kv_heads * keys * shape.head_dim * itemsize
    rows_bytes = 2 * shape.batch * shape.q_heads * shape.seq * 4  # lse and delta
    min_bytes = {"dq": 3 * q_bytes + kv_bytes + rows_bytes, "dkv": 2 * q_bytes + 2 * kv_bytes + rows_bytes}
    head_pairs = shape.q_heads * pairs  # (query, key) pairs of every query head; pairs is summed over the batch
    necessary = {k: 2 * m * head_pairs * shape.head_dim for k, m in NECESSARY_MATMULS.items()}
    num_outer = {
        "attention_tpu_flash_dq": -(-shape.seq // config.dq.block_q),
        "attention_tpu_flash_dkv": -(-shape.seq // config.dkv.block_kv),
    }
    calls = perf.model_pallas_traffic(backward_fn(built, shape, generation, config), *backward_args(shape, dtype),
                                      active_steps=backward_active_steps(num_outer))
    by_kernel = {"dq": calls[0], "dkv": calls[1]}
    assert [c.name for c in calls] == ["attention_tpu_flash_dq", "attention_tpu_flash_dkv"], [c.name for c in calls]
    gen = tpu_generation(generation)
    kernels_out = {}
    for name, call in by_kernel.items():
        modelled = perf.roofline(call, generation, min_bytes=min_bytes[name], min_flops=necessary[name])
        tiles = getattr(config, name)
        kernels_out[name] = {
            "block_q": tiles.block_q,
            "block_kv": tiles.block_kv,
            "kv_heads_per_step": tiles.kv_heads_per_step,
            "vmem_limit_bytes": tiles.vmem_limit_bytes,
            "grid": list(call.grid),
            "grid_steps": call.steps,
            "computed_steps": call.active_steps,
            "hbm_bytes": call.hbm_bytes,
            "min_bytes": min_bytes[name],
            "bytes_ratio": call.hbm_bytes / min_bytes[name],
            "necessary_flops": necessary[name],
            "block_flops": call.flops,
            "mxu_flops": call.mxu_flops(generation),
            "mxu_padding_efficiency": call.flops / call.mxu_flops(generation),
            "pipeline_buffers_vmem_bytes": call.vmem_bytes,
            "fits_vmem": modelled.fits_vmem,
            "overlap_time_us": modelled.time_s * 1e6,
            "modelled_pipelined_time_us": modelled.pipelined_time_s * 1e6,
            **calibration_bands.p90_fields(calibration_bands.band(
                {"flash_attention_vjp": modelled.pipelined_time_s}, generation, modelled.regime)),
            "roofline_us": modelled.roofline_s * 1e6,
            "overlap_pct_of_roofline": modelled.pct_of_roofline,
            "pipelined_pct_of_roofline": modelled.pipelined_pct_of_roofline,
            # necessary FLOPs / (pipelined time x bf16 peak)
            "modelled_mxu_utilisation_pct": 100.0 * necessary[name] / (modelled.pipelined_time_s * gen.device_bf16_flops_per_s),
            "bound": modelled.bound,
        }
    # delta = rowsum(d_out * out): XLA reads both once and writes a float32 row per query.
    delta_bytes = 2 * q_bytes + shape.batch * shape.q_heads * shape.seq * 4
    delta_us = delta_bytes / gen.device_hbm_bytes_per_s * 1e6  # an XLA op: both of v5p's cores
    ideal_flops = 2 * IDEAL_BACKWARD_MATMULS * head_pairs * shape.head_dim
    charged = relayout_fields(relayout)
    total_us = sum(k["modelled_pipelined_time_us"] for k in kernels_out.values()) + delta_us
    total_us += charged["relayout_us"] or 0.0
    return {
        "kernels": kernels_out,
        "visible_pairs_per_head": pairs,
        "delta_xla_bytes": delta_bytes,
        "delta_xla_us": delta_us,
        **charged,
        "total_modelled_us": total_us,
        "ideal_backward_us": ideal_flops / gen.device_bf16_flops_per_s * 1e6,
        "pct_of_ideal_backward": 100.0 * ideal_flops / gen.device_bf16_flops_per_s * 1e6 / total_us,
    }


def forward_time(built, shape: TrainingShape, dtype, generation: str) -> dict:
    """Modelled time of the forward at the same shape, for the backward/forward ratio: the kernel's pipelined
    time plus the copies XLA makes around it in a user's call (`forward_relayout_*`)."""
    plain = shape.as_shape()
    problem = built.Problem.of_shape(q_heads=shape.q_heads, kv_heads=shape.kv_heads, q_len=shape.seq,
                                     kv_len=shape.seq, head_dim=shape.head_dim, dtype=dtype,
                                     sliding_window=shape.sliding_window)
    config = built.flash.tiles.select(problem, resolve_target(generation))
    lengths = live_lengths(plain).astype(np.int32)
    calls = perf.model_pallas_traffic(kernel_fn(built, plain, generation), *avals(plain, dtype), lengths,
                                      active_steps=active_steps_from_prefetch(-(-shape.seq // config.block_q)))
    kernel_us = perf.roofline(calls, generation).pipelined_time_s * 1e6
    charged = relayout_fields(relayouts(kernel_fn(built, plain, generation), program_avals(plain, dtype), generation))
    return {"forward_modelled_us": kernel_us + (charged["relayout_us"] or 0.0), "forward_kernel_us": kernel_us,
            **{f"forward_{name}": value for name, value in charged.items()}}


def measure_backward(built, shape: TrainingShape, dtype) -> dict:
    entry = {"label": shape.label, "batch": shape.batch, "seq": shape.seq, "q_heads": shape.q_heads,
             "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "sliding_window": shape.sliding_window,
             "sinks": shape.sinks, "dtype": jnp.dtype(dtype).name, "per_generation": {}}
    for generation in GENERATIONS:
        problem = built.Problem.of_shape(
            q_heads=shape.q_heads, kv_heads=shape.kv_heads, q_len=shape.seq, kv_len=shape.seq,
            head_dim=shape.head_dim, dtype=dtype, sliding_window=shape.sliding_window,
        )
        config = built.flash_backward.tiles.select(problem, resolve_target(generation))
        relayout = relayouts(backward_fn(built, shape, generation), backward_program_avals(shape, dtype), generation)
        result = model_backward(built, shape, dtype, generation, config, relayout)
        result.update(forward_time(built, shape, dtype, generation))
        result["backward_over_forward"] = result["total_modelled_us"] / result["forward_modelled_us"]
        entry["per_generation"][generation] = result
    return entry


def sweep_backward(built, shape: TrainingShape, dtype, generation: str) -> dict:
    """Pipelined time of every (block_q, block_kv) per kernel that fits the VMEM budget, with the KV heads per
    step the heuristic gives those blocks; the best of each kernel."""
    best, rows = {}, []
    problem = built.Problem.of_shape(q_heads=shape.q_heads, kv_heads=shape.kv_heads, q_len=shape.seq,
                                     kv_len=shape.seq, head_dim=shape.head_dim, dtype=dtype)
    target = resolve_target(generation)
    for block_q in SWEEP_BLOCKS["block_q"]:
        for block_kv in SWEEP_BLOCKS["block_kv"]:
            tiles = {name: built.flash_backward.tiles.backward_tiles(name, problem, target, block_q=block_q,
                                                                     block_kv=block_kv)
                     for name in NECESSARY_MATMULS}
            if any(t is None for t in tiles.values()):
                continue
            config = built.flash_backward.tiles.BackwardConfig(**tiles)
            result = model_backward(built, shape, dtype, generation, config)
            for name, kernel in result["kernels"].items():
                rows.append({"kernel": name, "block_q": block_q, "block_kv": block_kv,
                             "kv_heads_per_step": tiles[name].kv_heads_per_step,
                             "pipelined_us": kernel["modelled_pipelined_time_us"],
                             "pct_of_roofline": kernel["pipelined_pct_of_roofline"]})
                if name not in best or kernel["modelled_pipelined_time_us"] < best[name]["pipelined_us"]:
                    best[name] = rows[-1]
    return {"best": best, "rows": rows}


def summarise_backward(results: list[dict]) -> dict:
    table = []
    for entry in results:
        for generation in GENERATIONS:
            result = entry["per_generation"][generation]
            for name, kernel in result["kernels"].items():
                table.append({
                    "shape": entry["label"], "generation": generation, "kernel": name,
                    "tiles": [kernel["block_q"], kernel["block_kv"], kernel["kv_heads_per_step"]],
                    "modelled_us": round(kernel["modelled_pipelined_time_us"], 1),
                    "band_p90_us": kernel["band_p90_us"],
                    "pct_of_roofline": round(kernel["pipelined_pct_of_roofline"], 1),
                    "modelled_mxu_utilisation_pct": round(kernel["modelled_mxu_utilisation_pct"], 1),
                    "mxu_padding_efficiency": round(kernel["mxu_padding_efficiency"], 3),
                    "bound": kernel["bound"],
                })
    relayout = {}
    for entry in results:
        charged = {g: {"backward": round(entry["per_generation"][g]["relayout_us"] or 0.0, 1),
                       "forward": round(entry["per_generation"][g]["forward_relayout_us"] or 0.0, 1)}
                   for g in GENERATIONS}
        if max(max(c.values()) for c in charged.values()) >= RELAYOUT_SHOWN_FROM_US:
            relayout[entry["label"]] = charged
    return {
        "relayout_charged_us": relayout,
        "target_pct_of_roofline_per_kernel": BACKWARD_TARGET_PCT,
        "kernels_meeting_target": sum(row["pct_of_roofline"] >= BACKWARD_TARGET_PCT for row in table),
        "kernels": len(table),
        "table": table,
        "note": (
            "pct_of_roofline = the kernel's roofline (necessary MXU work on visible pairs at the bf16 peak, or its "
            "minimum HBM bytes) / its calibrated pipelined modelled time (benchmarks.perf). band_p90_us: the "
            "model's p90 error on tokamax's measured flash attention vjp (" +
            calibration_bands.describe("flash_attention_vjp", "v5e") + "). At head_dim 128 v6e's 256-wide MXU "
            "pads every backward matmul 2x (mxu_padding_efficiency 0.5), capping those kernels near 50 %. "
            "relayout_charged_us: the copies XLA makes of the backward's arguments into the kernels' layout (d_out, "
            "q, k, v; out meets only XLA's delta, which reads it as given) and of dq, dk, dv back, and the forward's, "
            "per shape and generation where any are made: in total_modelled_us and forward_modelled_us, not in the "
            "per-kernel times. The kernels read and write every array in XLA's default layout (at head_dim 64 "
            "sequence-minor) where their blocks are multiples of 128, as the selected tiles are."
        ),
    }
