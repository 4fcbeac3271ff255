"""Each path's kernel, replayed and priced as `paged_attention` prices its kernels.

- ours after the gather (no gradient): the ragged paged kernel in contiguous mode
  (`paged.kernel.ragged_varlen_attention`) on the padded K, V and q, at flash_api's buckets;
- ours after the gather with a gradient: the flash kernel on every sequence padded to one length
  (`flash.kernel.flash_attention_forward` with per-sequence offsets and lengths, the arguments flash_api's
  `padded_varlen_attention` passes);
- ours in place: the ragged paged kernel on transformers' paged cache (`paged_attention.ours.measure`);
- vLLM RPA v3 in place: `paged_attention.rpa_v3.rpa_v3` (its fastest modelled block sizes that fit VMEM).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import perf
from benchmarks.studies import calibration_bands
from benchmarks.studies.attention.forward import active_steps_from_prefetch
from benchmarks.studies.paged_attention import ours as paged_ours
from benchmarks.studies.paged_attention import rpa_v3 as paged_rpa_v3
from benchmarks.studies.paged_attention.pricing import BAND_KIND, price, terms
from benchmarks.studies.relayouts import relayout_fields, relayouts
from benchmarks.studies.paged_attention.shapes import minimum_bytes, useful_flops
from tpu_kernels.runtime.hardware import resolve_target

from .steps import GENERATIONS, TRANSFORMERS_PAGE_SIZE, VLLM_PAGE_SIZE, Batch, Model, Sizes, cu_lens, gathered_rows

DTYPE = jnp.bfloat16


def _sinks(model: Model) -> list:
    return [jax.ShapeDtypeStruct((model.q_heads,), jnp.float32)] if model.sinks else []


def _kernel_row(modelled: dict) -> dict:
    """What a path keeps of a priced kernel: its time and band, bound, bytes, steps and the model's terms."""
    keep = ("modelled_time_us", "kernel_time_us", "relayout_us", "relayout_hbm_bytes", "relayouts", "relayout_missing",
            "hbm_roofline_us", "band_p90_us", "band_regime", "no_band", "bound", "hbm_bytes",
            "bytes_ratio", "grid_steps", "hbm_term_us", "mxu_us", "vector_us", "step_overhead_us", "tiles", "config",
            "error")
    return {key: modelled[key] for key in keep if key in modelled}


def ragged_contiguous(built, batch: Batch, model: Model, found: Sizes) -> dict:
    """Per generation: the ragged kernel over the gathered, padded K and V (flash_api's ragged path)."""
    keys = gathered_rows(batch, model)
    extra = found.ragged_sequences - found.sequences
    cu_q = cu_lens(list(batch.q_lens) + [0] * extra)
    cu_k = cu_lens(list(keys) + [0] * extra)
    inputs = [jax.ShapeDtypeStruct((found.ragged_query_rows, model.q_heads, model.head_dim), DTYPE),
              *[jax.ShapeDtypeStruct((found.ragged_key_rows, model.kv_heads, model.head_dim), DTYPE)] * 2,
              cu_q, cu_k, *_sinks(model)]
    replays, out = {}, {}
    for generation in GENERATIONS:
        def attend(q, k, v, cu_q_lens, cu_k_lens, sinks=None, generation=generation):
            return built.paged.kernel.ragged_varlen_attention(
                q, k, v, cu_q_lens, cu_k_lens, sinks=sinks, sliding_window=model.sliding_window,
                max_q_len=found.ragged_max_q_len, generation=generation)

        jaxpr = str(jax.make_jaxpr(attend)(*inputs))  # generations with the same tiles share a replay
        if jaxpr not in replays:
            replays[jaxpr] = perf.model_pallas_traffic(attend, *inputs)
        calls = replays[jaxpr]
        copies = relayouts(attend, inputs, generation)
        out[generation] = _kernel_row({**price(calls, batch, model, generation, copies), **terms(calls, generation)})
    return out


def padded_flash(built, batch: Batch, model: Model, found: Sizes) -> dict:
    """Per generation: the flash kernel over every sequence padded to one length (flash_api's gradient path's
    forward: q_offset = kv_len - q_len and kv_lengths per sequence, empty sequences to the batch bucket)."""
    keys = np.asarray(list(gathered_rows(batch, model)) + [0] * (found.padded_batch - found.sequences), np.int32)
    q_lens = np.asarray(list(batch.q_lens) + [0] * (found.padded_batch - found.sequences), np.int32)
    q = jax.ShapeDtypeStruct((found.padded_batch, model.q_heads, found.padded_query_rows, model.head_dim), DTYPE)
    kv = jax.ShapeDtypeStruct((found.padded_batch, model.kv_heads, found.padded_key_rows, model.head_dim), DTYPE)
    min_bytes, flops = minimum_bytes(batch, model), useful_flops(batch, model)
    out = {}
    for generation in GENERATIONS:
        problem = built.Problem.of_shape(q_heads=model.q_heads, kv_heads=model.kv_heads,
                                         q_len=found.padded_query_rows, kv_len=found.padded_key_rows,
                                         head_dim=model.head_dim, dtype=DTYPE, sliding_window=model.sliding_window,
                                         batch=found.padded_batch)
        config = built.flash.tiles.select(problem, resolve_target(generation))
        block_q = 1 if found.padded_query_rows == 1 else config.block_q

        def attend(q, k, v, q_offset, kv_lengths, sinks=None, config=config, generation=generation):
            return built.flash.kernel.flash_attention_forward(
                q, k, v, q_offset=q_offset, kv_lengths=kv_lengths, sinks=sinks, causal=True,
                sliding_window=model.sliding_window, config=config, generation=generation)[0]

        try:
            calls = perf.model_pallas_traffic(
                attend, q, kv, kv, keys - q_lens, keys, *_sinks(model),
                active_steps=active_steps_from_prefetch(-(-found.padded_query_rows // block_q)))
        except Exception as error:  # noqa: BLE001 - a path the model cannot replay is a row with the reason
            out[generation] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
            continue
        fitted = perf.roofline(calls, generation, min_bytes=min_bytes, min_flops=flops)
        charged = relayout_fields(relayouts(attend, [q, kv, kv, keys - q_lens, keys, *_sinks(model)], generation))
        relayout_s = (charged["relayout_us"] or 0.0) * 1e-6
        time_s = fitted.pipelined_time_s + relayout_s
        out[generation] = _kernel_row({
            "modelled_time_us": time_s * 1e6, "kernel_time_us": fitted.pipelined_time_s * 1e6, **charged,
            "hbm_roofline_us": fitted.roofline_s * 1e6, "bound": fitted.bound,
            "hbm_bytes": fitted.hbm_bytes, "bytes_ratio": fitted.hbm_bytes / min_bytes, "grid_steps": fitted.steps,
            "hbm_term_us": fitted.hbm_bound_s * 1e6, "step_overhead_us": fitted.overhead_s * 1e6,
            "tiles": {"block_q": block_q, "block_kv": config.block_kv},
            **terms(calls, generation),
            **calibration_bands.p90_fields(calibration_bands.band({BAND_KIND: fitted.pipelined_time_s}, generation,
                                                                  fitted.regime, uncalibrated_s=relayout_s))})
    return out


def in_place(built, batch: Batch, model: Model) -> dict:
    """Per generation: our ragged paged kernel reading transformers' paged cache in place (a block-table path)."""
    return {generation: _kernel_row(found)
            for generation, found in paged_ours.measure(built, batch, model, TRANSFORMERS_PAGE_SIZE).items()}


def vllm_in_place(batch: Batch, model: Model, wheels) -> dict:
    """Per generation: vLLM's RPA v3 reading its paged cache in place, as `paged_attention` prices it."""
    found = paged_rpa_v3.rpa_v3(batch, model, VLLM_PAGE_SIZE, wheels)
    if "per_generation" not in found:
        return {generation: {"error": found.get("error", "not priced")} for generation in GENERATIONS}
    return {generation: _kernel_row(row) for generation, row in found["per_generation"].items()}
