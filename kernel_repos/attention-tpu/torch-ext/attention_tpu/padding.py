"""The shapes the transformers-facing entry points hand the kernels: query and key lengths padded to buckets.

A kernel compiles once per shape it sees. Padding the query length to its token bucket and the key length to its
key bucket (`_buckets`) bounds those shapes per model, whatever the prompt lengths and however many tokens are
generated; the entry points pass the real key lengths (`kv_lengths`) and the real causal offsets, so the padded
keys are never visible and the padded queries' rows are cut off. One query stays one query: the flash kernel
lays a single query out on its own (a decode step reads the keys once for all heads of a group), and a decode
step is one shape already.
"""

from __future__ import annotations

import torch

from ._buckets import key_bucket, token_bucket


def query_rows(q_len: int) -> int:
    """The query length a kernel is handed for `q_len` queries: 1 stays 1 (decode), any other its token bucket."""
    return q_len if q_len <= 1 else token_bucket(int(q_len))


def key_rows(kv_len: int) -> int:
    """The key length a kernel is handed for `kv_len` keys: its key bucket (no keys stay no keys)."""
    return kv_len if kv_len == 0 else key_bucket(int(kv_len))


def padded(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`tensor` with zeros (False for a bool mask) appended along `dim` up to `size`."""
    extra = size - tensor.shape[dim]
    if extra == 0:
        return tensor
    pads = [0, 0] * (tensor.dim() - dim % tensor.dim())
    pads[-1] = extra
    return torch.nn.functional.pad(tensor, pads)
