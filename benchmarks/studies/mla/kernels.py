"""Our kernels of each form, replayed and priced: the latent kernel (absorbed) and flash attention with key and value
head dims nope + R and v (expanded), from the built attention kernel repo.

A build without the latent kernel (`latent/`) prices no absorbed form and says so. A build whose flash kernel takes
one head dim for keys and values prices the expanded form with q, K and V zero-padded to the smallest head dim it
takes (`STAND_IN`), and says so: that is an upper bound on the flash kernel with two head dims.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import perf
from benchmarks.studies import calibration_bands
from benchmarks.studies.attention.forward import active_steps_from_prefetch

from .shapes import ITEMSIZE, Call, MlaModel

DTYPE = jnp.bfloat16
BAND_KIND = "flash_attention"  # the calibrated kind whose error stands for attention kernels
STAND_IN = ("this build's flash kernel takes one head dim for keys and values: priced with q, K and V zero-padded "
            "to head dim {dim} (an upper bound on flash with key and value head dims {dk}/{dv})")


def _array(*shape, dtype=DTYPE) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _lengths(call: Call) -> np.ndarray:
    return np.full(call.batch, call.kv_len, np.int32)


def priced(calls, generation: str, min_bytes: int, **facts) -> dict:
    """A replayed kernel's calibrated pipelined time, its band (flash attention's error in its regime) and terms."""
    modelled = perf.roofline(calls, generation, min_bytes=min_bytes)
    return {"us": modelled.pipelined_time_s * 1e6, "hbm_bytes": modelled.hbm_bytes,
            "bytes_over_floor": modelled.hbm_bytes / min_bytes, "mxu_flops": modelled.mxu_flops,
            "grid_steps": modelled.steps, "step_overhead_us": modelled.overhead_s * 1e6,
            "hbm_term_us": modelled.hbm_bound_s * 1e6, "compute_term_us": modelled.compute_bound_s * 1e6,
            "fits_vmem": modelled.fits_vmem, "bound": modelled.bound,
            **calibration_bands.p90_fields(calibration_bands.band({BAND_KIND: modelled.pipelined_time_s}, generation,
                                                                  modelled.regime)), **facts}


def latent_kernel(built, model: MlaModel, call: Call, generation: str, min_bytes: int) -> dict:
    """The latent kernel over the latent cache (one shared KV head), at its own tiles for `generation`."""
    if not hasattr(built, "latent"):
        return {"error": "this build of attention-tpu has no latent kernel (attention_tpu.latent)"}
    b, h, q, s = call.batch, model.heads, call.q_len, call.kv_len

    def attend(q_latent, q_rope, latent, rope, kv_lengths):
        return built.latent.kernel.latent_attention(q_latent, q_rope, latent, rope, kv_lengths=kv_lengths,
                                                    causal=True, generation=generation)

    problem = built.latent.tiles.LatentProblem.of_shape(heads=h, q_len=q, kv_len=s, latent_dim=model.latent,
                                                        rope_dim=model.rope, dtype=DTYPE, batch=b)
    config = built.latent.tiles.select(problem, _target(built, generation))
    num_q_blocks = -(-q // config.block_q)
    calls = perf.model_pallas_traffic(attend, _array(b, h, q, model.latent), _array(b, h, q, model.rope),
                                      _array(b, 1, s, model.latent), _array(b, 1, s, model.rope), _lengths(call),
                                      active_steps=active_steps_from_prefetch(num_q_blocks))
    return priced(calls, generation, min_bytes, tiles={"block_q": config.block_q, "block_kv": config.block_kv,
                                                       "heads_per_step": config.heads_per_step})


def _target(built, generation: str):
    from tpu_kernels.runtime.hardware import resolve_target

    return resolve_target(generation)


def _flash_attend(built, generation: str):
    def attend(query, keys, values, kv_lengths):
        return built.flash.kernel.differentiable_flash_attention(query, keys, values, causal=True,
                                                                 kv_lengths=kv_lengths, generation=generation)

    return attend


def _flash_calls(built, call: Call, generation: str, heads: int, dk: int, dv: int):
    b, q, s = call.batch, call.q_len, call.kv_len
    problem = built.Problem.of_shape(q_heads=heads, kv_heads=heads, q_len=q, kv_len=s, head_dim=dk, dtype=DTYPE)
    block_q = 1 if q == 1 else built.flash.tiles.select(problem, _target(built, generation)).block_q

    return perf.model_pallas_traffic(_flash_attend(built, generation), _array(b, heads, q, dk), _array(b, heads, s, dk),
                                     _array(b, heads, s, dv), _lengths(call),
                                     active_steps=active_steps_from_prefetch(-(-q // block_q)))


def flash_kernel(built, model: MlaModel, call: Call, generation: str) -> dict:
    """Flash attention over the expanded keys [B, H, S, nope + R] and values [B, H, S, v] (every head its own KV
    head), or its stand-in (module docstring)."""
    dk, dv = model.key_dim, model.v
    min_bytes = ITEMSIZE * (call.batch * model.heads * (call.q_len * (dk + dv) + call.kv_len * (dk + dv)))
    try:
        out = jax.eval_shape(_flash_attend(built, generation), _array(1, 1, 1, dk), _array(1, 1, 128, dk),
                             _array(1, 1, 128, dv), np.full(1, 128, np.int32))
        if out.shape[-1] != dv:
            raise ValueError(f"the output's head dim is {out.shape[-1]}, not the values' {dv}")
        return priced(_flash_calls(built, call, generation, model.heads, dk, dv), generation, min_bytes,
                      head_dims=[dk, dv])
    except Exception as native_error:  # noqa: BLE001 - a build whose flash takes one head dim
        dims = sorted(d for d in getattr(built, "SUPPORTED_HEAD_DIMS", (64, 128, 256, 512)) if d >= max(dk, dv))
        if not dims:
            return {"error": f"flash {dk}/{dv}: {type(native_error).__name__}: {str(native_error).splitlines()[0]}"}
        calls = _flash_calls(built, call, generation, model.heads, dims[0], dims[0])
        return priced(calls, generation, min_bytes, head_dims=[dims[0], dims[0]],
                      stand_in=STAND_IN.format(dim=dims[0], dk=dk, dv=dv),
                      native_error=f"{type(native_error).__name__}: {str(native_error).splitlines()[0][:200]}")
