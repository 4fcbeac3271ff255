"""Each term of the step priced by the existing model: XLA programs compiled for v6e, our kernels by their benchmarks.

- XLA programs (`programs.Program`): compiled ahead of time through `moe_layer`'s compiler and disk cache and
  priced by `perf.program_time.model_program` (every op's HBM / VMEM traffic from the optimized HLO, its FLOPs
  at the MXU peak; no fixed cost per op; no calibrated error: `uncalibrated`).
- our experts layer: `moe_layer.measure_case` (its "EP8 router-masking" case at B tokens), its calibrated
  pipelined figure and the Pallas ragged dot's p90 band, as `multichip` takes it.
- our attention: `attention.forward.measure_generation` (the kernel's grid replayed at the cache length),
  flash attention's band.
- our RMSNorm: the kernel's grid replayed (`perf.model_pallas_traffic`) and priced by `perf.roofline`, as the
  `rmsnorm` benchmark does; no calibrated kind covers a norm.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from benchmarks import perf
from benchmarks.studies import calibration_bands, moe_layer
from benchmarks.studies.attention import forward as attention_forward
from benchmarks.studies.moe_layer import modelling

from .models import AttentionKind, DecodeModel
from .programs import EPS, Program

GENERATION = "v6e"


def term(name: str, us: float, per_step: int, *, priced_by: str, band_us: list[float] | None = None,
         kind: str = "uncalibrated", **facts) -> dict:
    """One row of the step's breakdown: µs per call, calls per step, ms per step, how it was priced."""
    low, high = band_us if band_us else (us, us)
    return {"term": name, "us_per_call": round(us, 3), "per_step": per_step,
            "ms_per_step": round(us * per_step / 1e3, 4),
            "ms_per_step_band": [round(low * per_step / 1e3, 4), round(high * per_step / 1e3, 4)],
            "priced_by": priced_by, "error_kind": kind, **facts}


class XlaPricer:
    """Compiles `Program`s for v6e (cached on disk with moe_layer's compiles) and prices them."""

    def __init__(self, cache: moe_layer.Cache, compiler: moe_layer.Compiler):
        self.cache, self.compiler = cache, compiler

    def submit(self, program: Program):
        return self.compiler.submit(program.fn, list(program.avals), GENERATION, kind="decode step XLA programs")

    def finish(self, program: Program, future) -> dict:
        compiled = future.result()
        if isinstance(compiled, dict):
            return term(program.name, float("nan"), program.per_step, priced_by="not priced",
                        error=compiled.get("error"))
        priced = modelling.price(compiled, perf.ProgramReplay((), ()))
        return term(program.name, priced.pipelined_time_s * 1e6, program.per_step,
                    priced_by="XLA program compiled for v6e, priced by perf.program_time",
                    hbm_bytes=priced.xla_hbm_bytes, flops=priced.xla_flops, xla_ops=priced.xla_ops,
                    xla_estimated_us=round(priced.xla_estimated_s * 1e6, 3),
                    **({"note": program.note} if program.note else {}))


def experts_term(built_experts, model: DecodeModel, batch: int, cache, compiler) -> tuple[dict, dict]:
    """Our experts layer on the busiest chip (moe_layer's EP8 router-masking case), and its moe_layer row."""
    label = f"{model.moe_layer_model} EP8 router-masking"
    setting = next(s for s in moe_layer.SETTINGS if s.label == label)
    case = moe_layer.make_case(setting, batch)
    row = moe_layer.measure_case(built_experts, case, cache, compiler, rivals=[], generations=(GENERATION,))()[0]
    ours = row["variants"]["ours"]
    if not moe_layer.modelled(ours):
        return term("experts: our fused experts layer", float("nan"), model.layers, priced_by="not priced",
                    error=ours.get("error")), row
    return term("experts: our fused experts layer (busiest chip)", ours["headline_us"], model.layers,
                priced_by=f"moe_layer's model of {moe_layer.LAYER_ENTRY} ({label}, T={batch}), compiled for v6e",
                band_us=ours["band"]["p90_us"], kind="pallas_ragged_dot",
                live_picks=row["live_picks"], active_experts=row["active_experts"],
                grid_steps=ours["kernels"]["grid_steps"], roofline_us=row["roofline_us"]), row


def attention_term(built_attention, kind: AttentionKind, batch: int, context: int) -> dict:
    """Our flash attention at decode over `kind`'s cache, as the attention benchmark prices it."""
    cached = kind.cached_tokens(context)
    shape = attention_forward.Shape(label=f"{kind.name} decode B={batch} cache={cached}", batch=batch, q_len=1,
                                    kv_len=cached, q_heads=kind.q_heads, kv_heads=kind.kv_heads,
                                    head_dim=kind.head_dim)
    visible = attention_forward.visible_work(built_attention.reference, shape, jnp.bfloat16)
    found = attention_forward.measure_generation(built_attention, shape, jnp.bfloat16, GENERATION, visible)
    return term(f"{kind.name} attention: our flash attention kernel", found["modelled_time_us"], kind.layers,
                priced_by="attention benchmark's grid replay of the kernel (measure_generation), v6e",
                band_us=found["band_p90_us"], kind="flash_attention", bytes_ratio=round(found["bytes_ratio"], 4),
                grid_steps=found["grid_steps"],
                roofline_us=round(found["roofline_us"], 3))


def norm_term(built_norm, what: str, rows: int, width: int, per_step: int) -> dict:
    """Our RMSNorm kernel at [rows, width], its grid replayed and priced (no calibrated kind covers it)."""
    fn = functools.partial(built_norm.norm.kernel.rms_norm_forward, eps=EPS, generation=GENERATION)
    calls = perf.model_pallas_traffic(fn, *_norm_avals(rows, width))
    modelled = perf.roofline(calls, GENERATION)
    return term(f"RMSNorm (our kernel): {what} [{rows}, {width}]", modelled.pipelined_time_s * 1e6, per_step,
                priced_by="the rmsnorm kernel's grid replayed, perf.roofline (as the rmsnorm benchmark)",
                grid_steps=sum(call.steps for call in calls))


def _norm_avals(rows: int, width: int):
    import jax

    return [jax.ShapeDtypeStruct((rows, width), jnp.bfloat16), jax.ShapeDtypeStruct((width,), jnp.bfloat16)]


def bands_used() -> dict:
    """The calibrated errors the terms carry (v6e's timings check but make no bands: v5e's; attention: TPU7x's)."""
    return {kind: calibration_bands.describe(kind, GENERATION) for kind in ("pallas_ragged_dot", "flash_attention")}
