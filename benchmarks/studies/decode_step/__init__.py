"""One whole decode step of Qwen3-30B-A3B and Gemma 4 26B-A4B at batch 64 on a v6e-8: default vs kernelized, modelled.

No TPU is needed. Hugging Face measured, on a v6e-8 at batch 64, the kernelized step (kernels-community's
ragged-dot-tpu) at 21.5x transformers' default for Qwen3-30B-A3B and 12.8x for Gemma 4 26B-A4B, and Qwen3's
kernelized step at 56.6 ms. This benchmark prices one step's device time on the busiest chip, term by term,
for both models at their real sizes (`models`, with sources) under a stated parallel plan (`models.PLAN_SOURCE`:
experts EP8 with router masking and one all-reduce per MoE layer; everything else replicated):

- `transformers_default`: transformers 5.25 as `generate` runs decode on a TPU: experts through `batched_mm`
  (each pick gathers its expert's weights, then a batched matvec: `programs.batched_mm_programs`), softmax
  attention over the KV cache, RMSNorm in torch ops, every one an XLA program;
- `kernelized_experts`: HF's configuration (kernels-community/ragged-dot-tpu replaces the experts only), with
  our fused experts layer; `hf_kernel_check` puts HF's own kernel (tokamax's, as moe_layer prices it) in;
- `kernelized`: our experts layer, flash attention and RMSNorm kernels;
- on every path: q/k/v/o projections, DynamicCache's append, the router, Gemma 4's dense MLP, the embedding,
  lm_head with argmax, and the experts' all-reduce.

The eager step's host time is not device time and is left out of the paths; `host_ops` counts the torch ops
each path dispatches per step (on the CPU, from each model's transformers code at tiny sizes), and the
`eager_host` entry gives the per-op host cost that makes Qwen3's step in HF's configuration equal HF's
measurement, and every path's step and ratio at that cost.

How each term is priced (`pricing`): XLA programs compiled ahead of time for v6e and priced by
`benchmarks.perf.program_time` (no calibrated error: none of the measurements covers such ops); our kernels
as their own benchmarks price them (moe_layer, attention, rmsnorm) with the calibrated error bands of their
kinds; the all-reduce by `benchmarks.perf.collectives`' formula. Each row of the JSON says which.

Output, benchmarks/results/decode_step.json (tracked, compact): per model, every path's terms (µs per call,
calls per step, ms per step, band, how priced), totals, the ratios beside HF's, HF's configuration beside
HF's 56.6 ms, the step with HF's own experts kernel as moe_layer prices it (`hf_kernel_check`: the 257 µs
question), the ratio with that kernel beside ours over the terms no timing identifies (`ratio_ranges`: grid-step
cost, HBM share, batched_mm's price), the eager host counts (`eager_host`), `explanation`: which term explains
each gap, and `method.fitted_to`: the measured figure each assumption was fitted to, if any.
`python -m benchmarks report` renders benchmarks/results/decode_step.md from it
(`benchmarks.studies.tables.decode_step`).

Usage:
    python -m benchmarks decode_step [--context 1024] [--batch 64] [--models ...] [--out PATH] [--jobs 2]
        [--cache-dir DIR] [--no-cache]
Paths are relative to the current directory: run from the project's checkout. Compiles share moe_layer's
disk cache: from an empty one a run takes minutes (our experts layers compile with their kernels; 5.7 minutes
on a loaded 2-core host), a warm one under a minute.

Modules: `models` (sizes, sources, plan), `programs` (the XLA programs), `pricing` (each term priced),
`host_ops` (eager ops per step), `step` (totals and comparisons), `ranges` (the ratio over the unidentified
terms), `run` (the command line).
"""

from .run import DEFAULT_OUT, main

__all__ = ["DEFAULT_OUT", "main"]
