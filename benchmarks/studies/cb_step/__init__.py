"""A continuous-batching attention step as transformers users run it on TPU, against reading the pages in place.

No TPU is needed. transformers 5.25's continuous batching (`model.generate_batch`, `transformers serve
--continuous-batching`) has a block-table path only on CUDA and XPU: on TPU each attention layer, at every step,
gathers each sequence's K and V from the paged cache into packed tensors (`steps` says how), then calls our
`flash_attn_varlen_func`, which pads them to their buckets for the ragged paged kernel (or, with a gradient, pads
every sequence to one length for the flash kernel). Per attention layer of Qwen3-30B-A3B, GPT-OSS-20B's sliding
layers and Gemma 4 26B-A4B's global layers, at two scheduler steps (64 decodes of mixed lengths; the same with a
prefill chunk), on v5e, v6e and TPU7x, the paths priced:

1. `transformers_ragged`: the gather, our bucketing pad, the ragged kernel in contiguous mode;
2. `transformers_padded`: the gather, the gradient path's per-sequence pad, the flash kernel, the unpad;
3. `ours_in_place`: our ragged paged kernel reading the cache's pages in place (what a block-table path gives),
   and `vllm_rpa_v3_in_place`: vLLM tpu-inference's RPA v3 likewise (`paged_attention`'s pricing of it);
4. per path, the share of its time that is copies (gather + pad) against the kernel.

Copies are XLA programs (`programs`), compiled for each generation's compile-only topology and priced by
`benchmarks.perf.program_time` (`xla`, uncalibrated); kernels are replayed and priced as `paged_attention` does
(`kernels`), with flash attention's calibrated p90 band. The JSON holds each path's total, gather, pad and kernel
figures, its band and its terms; the notes say whether the copies dominate and what would remove them.

Usage:
    python -m benchmarks cb_step [--out benchmarks/results/cb_step.json] [--repo kernel_repos/attention-tpu]
        [--wheels DIR] [--jobs N] [--cache-dir DIR] [--quick]
Modules: `steps`, `programs`, `xla`, `kernels`, `paths`, `summary`, `run`.
"""

from .run import DEFAULT_OUT, main

__all__ = ["DEFAULT_OUT", "main"]
