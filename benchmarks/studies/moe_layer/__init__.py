"""The MoE experts layer as users run it: ours vs the best-tuned rivals vs the roofline, modelled for v5e and v6e.

No TPU is needed. For every shape (model, expert-parallel rank, tokens) and
generation this benchmark models one whole experts layer, as kernelize runs
it and as a user would build it from each rival:

- ours: the kernel repo's own JAX entry behind its fused torch op
  (`LAYER_ENTRY`, today `experts_layer`), loaded from the built kernel
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
- vLLM's fused MoE kernel (`vllm_fused_ep_moe`), as vLLM's FUSED_MOE layer
  runs it: router logits in, routing, all-to-all, both matmuls and the
  combine in one kernel, at vLLM's own block sizes, its schedule counted at
  the shape's routing and priced by the same model (`vllm_fused`; what its
  figure leaves out is in each row's `not_priced`);
- labelled extra rows (never headlines): tokamax's kernel at tokamax
  0.0.12's own untuned pick (`tokamax_default`, the kernel Hugging Face's
  ragged-dot-tpu ships), and at decode shapes ours with int8 and fp8 expert
  weights.

Each layer is compiled ahead of time for the generation (libtpu
compile-only topology) and analysed by `benchmarks.perf.xla_program`: every XLA
op's HBM / VMEM traffic from the optimized HLO (where XLA placed each
buffer), XLA's ragged-dot loops replayed (`benchmarks.perf.xla_ragged_dot`), and
each Pallas kernel by `benchmarks.perf`'s grid replay, with the kernel
operands XLA placed in VMEM moving no HBM bytes. Ours compiles with its real
kernel bodies (that Mosaic accepts them is part of the result); the rivals'
layers compile with empty kernel bodies (`lower_program(kernel_bodies=False)`:
the XLA program and placements are the same, Mosaic's VMEM check of their
bodies is not made; their kernels' time is the replay's either way).

The headline is the calibrated pipelined figure (`pipelined_time_s`: each
grid step max(its compute, its neighbours' copies) + the fitted per-step cost
of the generation, `perf.grid_step_s`), the figure `python -m
benchmarks calibrate` holds against real chips. Every time carries the calibrated error
band of its terms in its regime (`calibration_bands`: Pallas kernels at the
Pallas ragged-dot error, XLA ragged-dot loops at theirs, both from the
measured calls of the layer's regime, streaming or compute-bound; other XLA
ops uncalibrated), or no band where that regime has no timing.
v6e's constants and bands are v5e's (v6e's own timings check them, not fit
them: calibration_v6e.json). The roofline of a
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
its concrete arguments and the source of the `benchmarks.perf` package.

What runs: by default the headline shapes (the anchor's rank in both EP
modes, at its decode batch and at the larger prefill; `shapes.HEADLINE_*`),
into benchmarks/results/moe_layer_headline_shapes.json (untracked); `--all` the full
sweep into benchmarks/results/moe_layer.json; either, from an empty cache,
adds its wall time to benchmarks/results/moe_layer_cold_times.json;
`--settings` / `--tokens` any subset (the full sweep's file unless `--out`).

Output: `--out` (benchmarks/results/moe_layer.json, tracked) holds one line
per (shape, generation) and per (shape, generation, variant), the targets and
the Hugging Face 257 us case, with sorted keys and no run facts; the raw rows
(every term, placement, searched config) and the run's own facts (seconds,
cache hits, load) go to benchmarks/results/raw/ (untracked).

Usage:
    python -m benchmarks moe_layer [--all] [--out benchmarks/results/moe_layer.json]
        [--repo kernel_repos/ragged-dot-tpu] [--settings LABEL ...] [--tokens T ...] [--jobs 2] [--no-cache]
        [--retarget]
    python -m benchmarks kernel_repos/ragged-dot-tpu [...]        (the same, --repo from the path)
    JAX_PLATFORMS=cpu python -m benchmarks.studies.moe_layer [...]
Paths are relative to the current directory: run from the project's checkout.

Modules, by concern: `shapes` (models, EP settings, routing), `ours` (the
built kernel's layer, quantized variants), `rivals` (the user's layer around
megablox / tokamax / XLA, their searched configs), `vllm_kernels` (vLLM's
kernels from its pinned wheel), `vllm_fused` (vLLM's fused kernel: its layer,
block sizes and counted schedule), `cache` (compiles and replays on disk, the
compile pool), `modelling` (a compiled layer's time),
`tuning` (each rival's best config), `measure` (one case's rows), `targets`
(ours against the rivals and the issues' targets), `hf` (the 257 us case),
`report` (JSON, table, plot), `run` (the command line). This package
re-exports what the other benchmarks use (`multichip`, `moe_backward`).
"""

from .cache import Cache, Compiler
from .measure import measure_case
from .ours import LAYER_ENTRY, QUANTIZED, build_folder, load_kernel, quantized_avals, quantized_min_bytes
from .report import dump_compact, rounded
from .rivals import RIVALS, rival_layer, stored_order
from .run import DEFAULT_CACHE, DEFAULT_OUT, DEFAULT_REPO, RAW_DIR, main
from .shapes import ANCHOR, MODELS, SETTINGS, Setting, make_case, projections
from .targets import modelled

__all__ = [
    "ANCHOR", "DEFAULT_CACHE", "DEFAULT_OUT", "DEFAULT_REPO", "LAYER_ENTRY", "MODELS", "QUANTIZED", "RAW_DIR",
    "RIVALS", "SETTINGS", "Cache", "Compiler", "Setting", "build_folder", "dump_compact", "load_kernel", "main",
    "make_case", "measure_case", "modelled", "projections", "quantized_avals", "quantized_min_bytes", "rival_layer",
    "rounded", "stored_order",
]
