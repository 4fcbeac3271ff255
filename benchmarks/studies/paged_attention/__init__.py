"""Ragged paged attention: our kernel's modelled speed against the HBM roofline and the MXU peak, and its rivals'.

No TPU is needed. Real model attention over a paged KV cache, bf16 (`shapes`):
Qwen3-30B-A3B (32 query / 4 KV heads, head_dim 128), GPT-OSS-20B's sliding
layers (64 / 8, head_dim 64, window 128, sinks; over pages of keys at their
positions, over window rings and as varlen keys: `shapes.CACHES`) and its full
layers (pages, varlen keys), Gemma 4 26B-A4B's global
layers (16 / 2, head_dim 512, from Gemma4TextConfig). Batches: a decode batch
of 64 sequences of mixed context lengths at page sizes 16 (vLLM's default
block size), 128 (vLLM TPU's usual) and 256 (transformers' paged cache);
decode batches of 64 at one context length each (the figure); one prefill
chunk with the decode rows (share of the MXU peak).

Each kernel is traced with abstract K/V caches and concrete page tables and
lengths, and replayed by `benchmarks.perf`: the grid's blocks by grid replay,
the K/V pages the kernel copies itself by running its scalar program at every
grid step (`perf.scalar_replay`: the loops over sequences and blocks, the
waits and their bytes, the matmuls and vector work that run), priced phase by
phase (a phase = one wait's copies and the work after it, overlapped with the
next phase's copies) on v5e, v6e and TPU7x at the fitted rates, with the
calibrated error band of the forward attention kernels in the figure's regime.
The roofline: the K/V rows some query sees read once, q read once, out
written once, at the peak HBM bandwidth (and at the fitted share).

Rivals at their own best configuration: jax's Pallas `paged_attention`
(decode only; the fastest modelled pages_per_compute_block) and vLLM
tpu-inference's RPA v3 (from the pinned wheel; `rpa_v3`: its fastest modelled
block sizes that fit VMEM, by coordinate descent from vLLM's default, which
each row keeps beside it; kernel_hd64 for head_dim 64, as vLLM runs it). A
rival that cannot run a shape, or that the model cannot price, has a row with
the reason.

Usage:
    python -m benchmarks paged_attention [--out benchmarks/results/paged_attention.json] [--repo kernel_repos/attention-tpu]
        [--wheels DIR] [--jobs N] [--quick] [--rivals-from JSON]
Modules: `shapes`, `ours`, `rivals`, `rpa_v3`, `pricing`, `summary`, `run`.
"""

from .run import DEFAULT_OUT, main

__all__ = ["DEFAULT_OUT", "main"]
