"""The shapes the transformers-facing entry points hand the kernels: query and key lengths padded to buckets.

A kernel compiles once per shape it sees. Padding the query length to its token bucket and the key length to its
key bucket (`_buckets`) bounds those shapes per model, whatever the prompt lengths and however many tokens are
generated; the entry points pass the real key lengths (`kv_lengths`) and the real causal offsets, so the padded
keys are never visible and the padded queries' rows are cut off. The batch is padded to a power of two with
sequences of no keys. One query stays one query: the flash kernel
lays a single query out on its own (a decode step reads the keys once for all heads of a group), and a decode
step is one shape already.
"""

from __future__ import annotations

import dataclasses

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


def lengths_tensor(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Per-sequence lengths or offsets as an int32 tensor made from host data: a value that changes every token
    (a real key length) reaches the device as data, never as the scalar argument of an op such as `torch.full`,
    whose every value TorchTPU's eager mode would compile as a program of its own."""
    return torch.tensor(lengths, dtype=torch.int32, device=device)


def batch_rows(batch: int) -> int:
    """The batch a kernel is handed for `batch` sequences: its power of two (no sequences stay none). The padded
    sequences have no keys: the kernels skip them and their rows come out zero."""
    return batch if batch == 0 else power_of_two(int(batch))


def power_of_two(size: int, floor: int = 1) -> int:
    """The power of two at or above `size`, and at least `floor` (a power of two): the bucket of a number of
    sequences."""
    return max(floor, 1 << max(size - 1, 0).bit_length())


# The fewest sequences the ragged kernel is handed: as many as the smallest token bucket (one row tile of queries)
# holds decode rows (a sequence of no rows costs the kernel a few scalar steps); below it a shape change would
# compile anew for next to no saving. Its fewest rows are the smallest buckets: 16 queries, 128 keys.
RAGGED_SEQUENCES_FLOOR = 16


def with_empty_sequences(cu_seqlens: torch.Tensor, batch: int) -> torch.Tensor:
    """`cu_seqlens` extended by empty sequences to `batch` of them."""
    extra = batch + 1 - cu_seqlens.shape[0]
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(extra)]) if extra else cu_seqlens


def query_length_bound(max_seqlen_q: int, rows: int) -> int:
    """The bound on any sequence's queries the ragged kernel is told (it only shapes its tiles): 1 for a decode
    batch, else the token bucket of the longest sequence's queries, and no more than the query rows."""
    if max_seqlen_q <= 1:
        return 1
    return min(token_bucket(int(max_seqlen_q)), rows)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """One transformers-facing call's real sizes and the bucketed sizes its kernel is handed: the batch padded to
    `sequences`, queries to `q_rows`, keys to `kv_rows` (arrays [B, H, S, D] along dims 0 and 2)."""

    batch: int
    q_len: int
    kv_len: int
    sequences: int
    q_rows: int
    kv_rows: int

    @classmethod
    def of(cls, batch: int, q_len: int, kv_len: int) -> Buckets:
        return cls(batch, q_len, kv_len, batch_rows(batch), query_rows(q_len), key_rows(kv_len))

    def queries(self, tensor: torch.Tensor) -> torch.Tensor:
        """A [B, H, Sq, ...] array at the bucketed batch and query length."""
        return padded(padded(tensor, 2, self.q_rows), 0, self.sequences)

    def keys(self, tensor: torch.Tensor) -> torch.Tensor:
        """A [B, H, Skv, ...] array at the bucketed batch and key length."""
        return padded(padded(tensor, 2, self.kv_rows), 0, self.sequences)

    def mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A [B or 1, 1, Sq, Skv] mask at the bucketed sizes (a batch of 1 broadcasts and stays 1)."""
        mask = padded(padded(mask, 2, self.q_rows), 3, self.kv_rows)
        return padded(mask, 0, self.sequences) if mask.shape[0] == self.batch else mask

    def key_lengths(self, device) -> torch.Tensor:
        """int32 [sequences]: the real key length of each real sequence, 0 for the padded ones (they see no key)."""
        return lengths_tensor([self.kv_len] * self.batch + [0] * (self.sequences - self.batch), device)

    def unpadded(self, out: torch.Tensor) -> torch.Tensor:
        """A kernel's [B, H, Sq, ...] output cut back to the real batch and queries."""
        return out[:self.batch, :, :self.q_len]


@dataclasses.dataclass(frozen=True)
class PackedBuckets:
    """A varlen call's packed sequences (sequence b on rows cu_seqlens[b]:cu_seqlens[b + 1] of a [total, H, D] array)
    laid out as the batch a kernel is handed: the sequences padded to a power of two with empty ones, queries to the
    token bucket and keys to the key bucket of the longest. Each sequence's queries are the last of its keys
    (`query_offsets`): its cached keys come first. The lengths stay on the device, as data."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    q_rows: int
    kv_rows: int

    @classmethod
    def of(cls, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
           max_seqlen_k: int) -> PackedBuckets:
        sequences = batch_rows(cu_seqlens_q.shape[0] - 1)
        return cls(with_empty_sequences(cu_seqlens_q, sequences), with_empty_sequences(cu_seqlens_k, sequences),
                   query_rows(max(max_seqlen_q, 1)), key_rows(max(max_seqlen_k, 1)))

    def queries(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed queries [total_q, H, D] -> [sequences, H, q_rows, D]."""
        return _by_sequence(packed, self.cu_seqlens_q, self.q_rows)

    def keys(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed keys (or values) [total_k, H, D] -> [sequences, H, kv_rows, D]."""
        return _by_sequence(packed, self.cu_seqlens_k, self.kv_rows)

    def key_lengths(self) -> torch.Tensor:
        """int32 [sequences]: each sequence's keys (0 for the padded ones: they see no key)."""
        return self.cu_seqlens_k.diff().to(torch.int32)

    def query_offsets(self) -> torch.Tensor:
        """int32 [sequences]: the key position of each sequence's first query (its keys less its queries)."""
        return (self.cu_seqlens_k.diff() - self.cu_seqlens_q.diff()).to(torch.int32)

    def packed(self, out: torch.Tensor, total_q: int) -> torch.Tensor:
        """A kernel's [sequences, H, q_rows, D] output back at the packed rows [total_q, H, D]; rows past the last
        sequence's (continuous batching pads the batch with them) come out zero."""
        token = torch.arange(total_q, device=out.device)
        real_sequences = self.cu_seqlens_q[1:].to(torch.int64)
        sequence = torch.bucketize(token, real_sequences, right=True)
        inside = sequence < real_sequences.shape[0]
        sequence = sequence.clamp(max=real_sequences.shape[0] - 1)
        index = (token - self.cu_seqlens_q[sequence].to(torch.int64)).clamp(0, self.q_rows - 1)
        return torch.where(inside[:, None, None], out[sequence, :, index], 0)


def _by_sequence(packed: torch.Tensor, cu_seqlens: torch.Tensor, rows: int) -> torch.Tensor:
    """Packed [total, H, D] -> [B, H, rows, D]; rows past a sequence's end repeat its last row (the kernels mask
    them by length). Bounded by the lengths, which are data: the total, which changes every step, is no scalar of
    an op."""
    cu_seqlens = cu_seqlens.to(torch.int64)
    rows_of = cu_seqlens[:-1, None] + torch.arange(rows, device=packed.device)[None, :]
    index = torch.minimum(rows_of, cu_seqlens[1:, None] - 1).clamp(min=0)
    return packed[index].transpose(1, 2)
