"""One MLA layer's attention (DeepSeek-V3, Moonlight-16B-A3B / DeepSeek-V2-Lite, GLM-4.7-Flash), modelled per call
and TPU generation: transformers' own path, our two forms and the one priced cheaper, vLLM's MLA kernel, and the
latent cache's floor.

No TPU is needed. transformers 5.25 caches an MLA layer's compressed latent and at every call re-expands every
cached token through kv_b_proj into per-head keys and values, then runs attention over them. Ours either folds
W_UK into the query and runs the latent kernel over the cache as one shared KV head, W_UV after it (absorbed), or
expands once and runs flash attention with key and value head dims nope + R and v (expanded); the kernel's rule
(`attention_tpu.mla.absorbed_is_cheaper`) picks one per call, and the JSON says where it agrees with the model.

Per model (`shapes.MODELS`: heads per chip under a stated plan, widths from the released configs) and each of its
generations, decode batches of 8 and 64 over 4096 and 32768 cached tokens and prefill chunks of 128 to 8192 tokens
(`shapes.DECODE`, `shapes.PREFILL`):

- `transformers`: its expansion and sdpa, each eager op its own XLA program (`programs`), compiled ahead of time for
  the generation and priced by `benchmarks.perf.program_time`;
- `absorbed`, `expanded`: those XLA programs plus our kernel, replayed and priced as the attention study prices
  flash attention (`kernels`), with flash attention's calibrated p90 band around the kernel;
- `vllm_mla`: tpu-inference 0.32.0's MLA v2 kernel from the pinned wheel (`vllm_mla`), at its fastest modelled
  block sizes (a coordinate descent from vLLM's default), beside vLLM's default, with the same two matmuls;
- `floor`: the latent cache read once at the fitted HBM share.

Output: benchmarks/results/mla.json (`summary`: the table's rows, the crossover per model and generation, the rule
against the model); `python -m benchmarks report` renders mla.md (`benchmarks.studies.tables.mla`).

Usage:
    python -m benchmarks mla [--models KEY ...] [--generations G ...] [--quick] [--no-vllm] [--repo DIR] [--jobs 2]
Modules: `shapes`, `programs`, `kernels`, `vllm_mla`, `measure`, `summary`, `run`.
"""

from .run import DEFAULT_OUT, main

__all__ = ["DEFAULT_OUT", "main"]
