"""What padding to shape buckets costs: rows and bytes per bucket for Qwen3-30B-A3B, GPT-OSS-20B and Gemma 4 26B-A4B.

The kernels' transformers entry points pad sizes to buckets (`tpu_kernels/runtime/buckets.py`) so that a model
compiles each kernel once per bucket: token counts (RMSNorm rows, experts tokens, attention query lengths, and the
tokens of the per-head q and k norms, whose rows are tokens x heads) to token buckets, attention key lengths to key
buckets. For each bucket, each entry point and each model (shapes as the kernel repos' `compile_targets.py` state
them, bf16), per call of one layer:

- `padded_rows`: the rows padded at the worst size the bucket holds (one past the bucket below) and on average
  over the sizes it holds (for `rms_norm_per_head`, tokens: each pads a row per q and k head);
- `kernel_bytes`: the HBM bytes the kernel moves for the padded rows at the worst size: an RMSNorm reads and
  writes each row (`rms_norm_per_head`: a padded token's q and k heads, for the models that norm them); the
  experts kernels read a padded token's row and write its (zero) output row, and read no weights for it (its
  picks are the sentinel); attention reads each padded query row and writes its output row, and reads no padded
  key (the kernel skips key blocks past the real lengths, `kv_lengths`);
- `pad_copy_bytes`: the bytes `torch.nn.functional.pad` moves at the worst size: it reads the real rows and
  writes the padded tensor (for attention keys: K and V, the whole cache each call);
- `real_bytes`: for scale, the bytes the kernel moves for the real rows at that size (their rows read and
  written; for attention keys, K and V read once; expert weights not counted);
- `seconds`: both byte counts at each generation's HBM rate (`hardware.tpu_generation(g).hbm_bytes_per_s`): the
  time of a memory-bound copy, a lower bound, not a replay of the kernels. Padded query rows also cost MXU work
  (`query_flops`: against every real key, at the bucket's worst size), which the seconds do not include.

Usage:
    python -m benchmarks padding [--out benchmarks/results/padding.json] [--max-tokens N] [--max-keys N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.studies import result_path, write_json
from tpu_kernels.runtime.buckets import key_buckets, token_buckets
from tpu_kernels.runtime.hardware import tpu_generation

DEFAULT_OUT = result_path("padding.json")
GENERATIONS = ("v5e", "v6e", "tpu7x")
BF16 = 2
INDEX_BYTES = 8  # router picks: int64 from torch.topk
ROUTING_WEIGHT_BYTES = 4

# compile_targets.py of each kernel repo: experts (ragged-dot-tpu), attention heads (attention-tpu; Gemma 4's
# global layers, its largest head), hidden size (rmsnorm-tpu's HIDDEN_SIZES); qk_norms: an RMSNorm over each
# q and k head.
MODELS = {
    "qwen3-30b-a3b": dict(hidden=2048, top_k=8, q_heads=32, kv_heads=4, head_dim=128, qk_norms=True),
    "gpt-oss-20b": dict(hidden=2880, top_k=4, q_heads=64, kv_heads=8, head_dim=64, qk_norms=False),
    "gemma-4-26b-a4b": dict(hidden=2816, top_k=8, q_heads=16, kv_heads=2, head_dim=512, qk_norms=True),
}


def _padded_rows(bucket: int, below: int) -> dict:
    """Rows padded when a size the bucket holds (below + 1 .. bucket) is padded to it: at the worst, on average."""
    sizes = range(below + 1, bucket + 1)
    return dict(worst=bucket - sizes[0], mean=sum(bucket - n for n in sizes) / len(sizes))


def _row_bytes(model: dict) -> dict:
    """Per entry point: bytes the kernel moves per padded row, bytes the pad reads per real row and writes per
    padded-tensor row, bytes the kernel moves per real row."""
    hidden, top_k = model["hidden"], model["top_k"]
    query_row = model["q_heads"] * model["head_dim"] * BF16
    key_row = 2 * model["kv_heads"] * model["head_dim"] * BF16  # K and V
    routing = top_k * (INDEX_BYTES + ROUTING_WEIGHT_BYTES)
    heads_row = (model["q_heads"] + model["kv_heads"]) * model["head_dim"] * BF16  # a token's q and k heads
    return {
        "rms_norm": dict(kernel=2 * hidden * BF16, copy=hidden * BF16, real=2 * hidden * BF16),
        "rms_norm_per_head": dict(kernel=2 * heads_row, copy=heads_row, real=2 * heads_row),
        "experts": dict(kernel=2 * hidden * BF16, copy=hidden * BF16 + routing, real=2 * hidden * BF16),
        "attention_queries": dict(kernel=2 * query_row, copy=query_row, real=2 * query_row),
        "attention_keys": dict(kernel=0, copy=key_row, real=key_row),
    }


def _seconds(nbytes: int) -> dict:
    return {g: nbytes / tpu_generation(g).hbm_bytes_per_s for g in GENERATIONS}


def bucket_costs(model: dict, entry_point: str, buckets: list[int]) -> list[dict]:
    """One entry per bucket: padded rows, the kernel's and the pad's bytes and their HBM time at the worst size."""
    per_row = _row_bytes(model)[entry_point]
    rows = []
    for below, bucket in zip([0, *buckets], buckets):
        padded = _padded_rows(bucket, below)
        real = bucket - padded["worst"]
        kernel_bytes = padded["worst"] * per_row["kernel"]
        copy_bytes = (real + bucket) * per_row["copy"]
        entry = dict(bucket=bucket, holds=[below + 1, bucket], padded_rows=padded, kernel_bytes=kernel_bytes,
                     pad_copy_bytes=copy_bytes, real_bytes=real * per_row["real"],
                     kernel_seconds=_seconds(kernel_bytes), pad_copy_seconds=_seconds(copy_bytes))
        if entry_point == "attention_queries":
            # Padded queries against the real keys of a prefill of the worst size: QK^T and PV, 2 FLOPs a MAC.
            entry["query_flops"] = 4 * padded["worst"] * real * model["q_heads"] * model["head_dim"]
        rows.append(entry)
    return rows


def study(max_tokens: int, max_keys: int) -> dict:
    tokens, keys = token_buckets(max_tokens), key_buckets(max_keys)
    ladders = dict(rms_norm=tokens, rms_norm_per_head=tokens, experts=tokens, attention_queries=tokens,
                   attention_keys=keys)
    return {
        "method": __doc__.split("Usage:")[0].strip(),
        "token_buckets": tokens,
        "key_buckets": keys,
        "generations": list(GENERATIONS),
        "models": {
            name: dict(shapes=shapes, entry_points={
                entry: bucket_costs(shapes, entry, ladder) for entry, ladder in ladders.items()
                if shapes["qk_norms"] or entry != "rms_norm_per_head"})
            for name, shapes in MODELS.items()
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-tokens", type=int, default=8192, help="the largest token count priced")
    parser.add_argument("--max-keys", type=int, default=131072, help="the largest key length priced")
    args = parser.parse_args(argv)
    results = study(args.max_tokens, args.max_keys)
    for name, model in results["models"].items():
        for entry, costs in model["entry_points"].items():
            worst = max(costs, key=lambda c: c["kernel_seconds"]["v6e"] + c["pad_copy_seconds"]["v6e"])
            v6e_us = 1e6 * (worst["kernel_seconds"]["v6e"] + worst["pad_copy_seconds"]["v6e"])
            print(f"{name:16s} {entry:18s} worst bucket {worst['bucket']:6d}: {worst['padded_rows']['worst']} rows, "
                  f"kernel {worst['kernel_bytes'] / 2**20:.1f} MiB, pad copy {worst['pad_copy_bytes'] / 2**20:.1f} "
                  f"MiB (real rows {worst['real_bytes'] / 2**20:.1f} MiB), v6e {v6e_us:.1f} us")
    print(f"wrote {write_json(args.out, results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
