"""Attention kernels: HBM bytes and MXU work of their grids vs the minimum, skipped blocks, v6e compile-only cost.

No TPU is needed. For each shape (Qwen3-30B-A3B attention unless noted: 32
query heads, 4 KV heads, head_dim 128, bf16) this

- replays the kernel's grid with `benchmarks.perf.model_pallas_traffic` to
  count the bytes its BlockSpecs move between HBM and VMEM, and compares them
  with the minimum: q read once, out written once, and the keys/values some
  query can see read once (up to each sequence's length, inside the window);
- counts, independently of the kernel, the (batch, kv head, q block, kv block)
  tiles holding at least one visible (query, key) pair, from the float64
  reference's own visibility mask, and checks that the kernel computes exactly
  those tiles (its `pl.when`) and fetches no K block outside them (its clamped
  index maps): "prefill skips all fully masked causal blocks";
- reports FLOPs: the useful 4 * visible pairs * head_dim, and the MXU work of
  the computed tiles;
- models the time on v5e, v5p, v6e and TPU7x (`perf.roofline`): the headline
  `modelled_time_us` is the calibrated pipelined figure (each grid step
  max(its compute, its neighbours' copies) + the generation's fitted step
  cost; MXU per pass, vector-unit work of the softmax at the rates fitted to
  tokamax's TPU7x flash attention timings), with that calibration's error band
  (`calibration_bands`, kinds flash_attention and flash_attention_vjp: measured
  on TPU7x only: its TPU7x figures are the calibrated ones; v5e, v5p and v6e
  have no attention measurements, the band is TPU7x's); `overlap_time_us` is the figure in which MXU work fully overlaps
  the copies (the headline before calibration);
- charges the copies XLA makes around the kernel in a user's call: each priced
  program (the forward's call, the backward's pullback) is compiled as
  kernelize's binding runs it, its arguments in XLA's default layouts
  (`perf.argument_layouts`, kernel bodies empty: about a second each); at
  head_dim 64 XLA stores [B, H, S, 64] with S minor: the forward kernel reads
  q, K and V so (their swapped views) and writes its output so, and the
  backward's kernels read d_out, q, k and v and write dq, dk and dv so, and
  nothing is copied (a config whose blocks are no multiple of 128 reads them
  row-major, and then XLA copies them). Rows carry
  `relayout_us` (in `modelled_time_us`, uncalibrated, at the fitted HBM share),
  `relayout_at_peak_bw_us`, `relayout_hbm_bytes` and `relayouts`, or
  `relayout_missing` with the reason; `kernel_time_us` is the kernel alone.
  There are no kernel rivals here to charge;
- compiles the kernel ahead of time for v6e (libtpu compile-only topology),
  records `cost_analysis()`, and the same for plain-jnp attention compiled by
  XLA as a baseline (XLA picks its own program's layouts: whatever it copies is
  in its cost).

Targets: decode moves <= 1.1x the minimum bytes; prefill computes
and fetches no fully masked block.

Backward, at training shapes of T = 8192 tokens per rank
(Qwen3-30B-A3B causal, Gemma-4-26B-A4B's sliding layers, GPT-OSS-20B with
sinks), per generation:

- each backward kernel (dq; dk/dv) replayed like the forward, against its own
  roofline: max(its necessary MXU work on visible pairs at the bf16 peak, its
  minimum HBM bytes at the HBM bandwidth). Necessary work: dq recomputes S and
  dP and computes dS K (3 matmuls, 6 * pairs * D FLOPs per head); dk/dv
  recomputes S and dP and computes P^T dO and dS^T q (4 matmuls, 8 * pairs * D).
  Minimum bytes: every array the kernel reads or writes once (q, d_out, the
  visible keys and values, lse and delta rows, the gradients it writes). The
  "modelled MXU utilisation" is that necessary work / (modelled time x peak);
  target >= 80 % per kernel. `mxu_padding_efficiency` = FLOPs on the block
  shapes / FLOPs after padding to the MXU (128 on v5e, 256 on v6e, from jax's
  TPU table): at head_dim 128 every backward matmul has D as a contraction or
  output width, so v6e's 256-wide MXU caps them at 50 %.
- the whole backward: both kernels plus delta = rowsum(d_out * out) (and the
  sink gradient), plain XLA outside the kernels, counted as its HBM bytes at
  the HBM bandwidth; against the ideal 5-matmul backward (10 * pairs * D), and
  as a ratio to the modelled forward time at the same shape; both totals
  include XLA's relayout copies around the call (above), the per-kernel times
  do not.
- `--sweep` replays a grid of (block_q, block_kv) per kernel and generation
  and prints the best, which is where PREFERRED_BACKWARD_TILES
  (flash_backward/tiles.py) come from; every swept tile must also fit the
  VMEM budget.

Usage:
    python -m benchmarks attention [--out benchmarks/results/attention.json] [--repo kernel_repos/attention-tpu]
        [--quick] [--sweep]
    (or JAX_PLATFORMS=cpu python -m benchmarks.studies.attention; paths relative to the current directory)
Modules: `forward` (shapes, visibility counts, the forward's measures),
`backward` (training shapes, the backward kernels, the tile sweep), `run`
(the command line).
"""

from .run import DEFAULT_OUT, main

__all__ = ["DEFAULT_OUT", "main"]
