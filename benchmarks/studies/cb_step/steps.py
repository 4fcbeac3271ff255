"""The steps: continuous-batching batches on real models' attention layers, and the row counts each path copies.

What transformers 5.25's continuous batching hands `flash_attn_varlen_func` on TPU (no block table off CUDA and
XPU; `generation/continuous_batching/cache_allocators`): per sequence, the rows its read index names, gathered
from the paged cache by `torch.index_select` into packed K and V [total_k, Hkv, D]:

- a full-attention layer writes the new tokens first, then reads every token of the sequence back
  (`FullAttentionCacheAllocator.get_read_indices`: past + new rows);
- a sliding layer reads at most window - 1 cached tokens, then new-token slots that `masked_scatter_` fills
  with the new keys and values (`SlidingAttentionCacheAllocator`: min(past, window - 1) + new rows).

The read index is the batch's true rows (`ModelRunner.pad_inputs` pads it only under accelerator graphs or
torch.compile, and TPU has no graph backend in transformers). Then our
`flash_attn_varlen_func` (kernel_repos/attention-tpu, `flash_api.py` and `padding.py`) pads sizes to buckets
(`tpu_kernels.runtime.buckets`: token buckets for query rows and lengths, key buckets for key rows and lengths,
powers of two for the number of sequences): without a gradient (`ragged_varlen_attention`) the rows of q and of
K, V and the number of sequences; with one (`padded_varlen_attention`) the batch and each sequence's query and
key length, every sequence padded to them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks.studies.paged_attention.shapes import GENERATIONS, Batch, Model, decode_batches, mixed_batch
from benchmarks.studies.paged_attention.shapes import LAYERS as MODELS
from tpu_kernels.runtime.buckets import key_bucket, token_bucket

__all__ = ["GENERATIONS", "MODELS", "Batch", "Model", "batches", "Sizes", "sizes", "gathered_rows", "bucket"]

# padding.py's fewest sequences of the ragged path (tests hold it to the source).
RAGGED_SEQUENCES_FLOOR = 16
# transformers' paged cache block size (ContinuousBatchingConfig's default), and vLLM TPU's usual one.
TRANSFORMERS_PAGE_SIZE = 256
VLLM_PAGE_SIZE = 128


def batches() -> list[Batch]:
    """The scheduler's two kinds of step: 64 decodes of mixed lengths, and the same with one prefill chunk."""
    return [decode_batches()[0], mixed_batch()]


def bucket(size: int, floor: int = 1) -> int:
    """padding.py's rounding of a number of sequences: the power of two at or above `size`, and at least `floor`."""
    return max(floor, 1 << max(size - 1, 0).bit_length())


def gathered_rows(batch: Batch, model: Model) -> tuple[int, ...]:
    """Per sequence, the rows transformers' read index gathers for this layer (its keys for the kernel)."""
    if model.sliding_window is None:
        return tuple(batch.kv_lens)
    return tuple(min(kv - q, model.sliding_window - 1) + q for q, kv in zip(batch.q_lens, batch.kv_lens))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One step's sizes on one layer: what is gathered, and what each of our paths pads it to."""

    sequences: int
    total_q: int
    total_k: int  # rows gathered from the cache (K, and as many of V)
    max_q: int
    max_k: int
    ragged_sequences: int
    ragged_query_rows: int
    ragged_key_rows: int
    ragged_max_q_len: int  # the query-length bound the ragged kernel is told
    padded_batch: int
    padded_query_rows: int  # per sequence
    padded_key_rows: int  # per sequence


def sizes(batch: Batch, model: Model) -> Sizes:
    keys = gathered_rows(batch, model)
    total_q, total_k = batch.total_q, sum(keys)
    max_q = max(batch.q_lens)
    query_rows = token_bucket(total_q)
    max_q_len = 1 if max_q <= 1 else min(token_bucket(max_q), query_rows)
    return Sizes(sequences=len(keys), total_q=total_q, total_k=total_k, max_q=max_q, max_k=max(keys),
                 ragged_sequences=bucket(len(keys), RAGGED_SEQUENCES_FLOOR), ragged_query_rows=query_rows,
                 ragged_key_rows=key_bucket(total_k), ragged_max_q_len=max_q_len,
                 padded_batch=bucket(len(keys)), padded_query_rows=max_q if max_q <= 1 else token_bucket(max_q),
                 padded_key_rows=key_bucket(max(keys)))


def cache_rows(batch: Batch, model: Model, page_size: int = TRANSFORMERS_PAGE_SIZE) -> int:
    """Rows of the layer's cache the gather reads from: every sequence's pages (a sliding layer keeps a window)."""
    if model.sliding_window is not None:
        return len(batch.kv_lens) * -(-model.sliding_window // page_size) * page_size
    return sum(-(-kv // page_size) * page_size for kv in batch.kv_lens)


def read_index(batch: Batch, model: Model, page_size: int = TRANSFORMERS_PAGE_SIZE) -> np.ndarray:
    """A read index as transformers builds it, every sequence on pages of its own in order: full layers read rows
    0..kv_len of their pages; sliding layers their last min(past, window - 1) cached rows (slot = position %
    window) then `sentinel` (-1 here) slots for the new tokens."""
    index, start = [], 0
    for q, kv in zip(batch.q_lens, batch.kv_lens):
        if model.sliding_window is None:
            index.append(np.arange(start, start + kv))
            start += -(-kv // page_size) * page_size
            continue
        window_rows = -(-model.sliding_window // page_size) * page_size
        past = kv - q
        cached = min(past, model.sliding_window - 1)
        first = 0 if past < model.sliding_window else (past + 1) % model.sliding_window
        index.append(start + (first + np.arange(cached)) % model.sliding_window)
        index.append(np.full(q, -1))
        start += window_rows
    return np.concatenate(index).astype(np.int64)


def cu_lens(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
