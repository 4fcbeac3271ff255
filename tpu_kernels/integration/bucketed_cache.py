"""A dynamic cache at bucket sizes: transformers' DynamicCache whose full-attention layers grow in key-bucket steps.

transformers' DynamicLayer concatenates each token's keys and values onto the cache, so every decode step hands
attention keys one longer than the last: under TorchTPU's strict eager a new program per token for the `cat`, and
for our attention's pad of the keys, values and mask to their key bucket. `BucketedLayer` stores them at the key
bucket (`runtime/buckets.py`) that holds every token so far and writes each update in place, at positions it keeps
as a device tensor: a decode step's ops see the same shapes and scalars until the cache crosses a bucket edge, and
attention gets keys already at their bucket, the unwritten rows hidden by the causal mask (the cache's mask size is
its capacity, as a static cache's is). The length as data also reaches the model's positions (`get_seq_length`
returns it, as StaticLayer's does).

What transformers still runs per token in the forward is the 2-D attention mask `generate` grows by one column per
token: its cast to bool and its pad to the cache's capacity (tests/test_op_signatures.py counts them). Layers of
another kind (sliding windows, chunked, linear attention) keep transformers' own.

The fixed-shape recipe (`fixed_shapes`) hands this cache to every `generate` that asks for a dynamic cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..runtime.buckets import key_bucket


class BucketedLayer(DynamicLayer):
    """keys and values [B, H, capacity, D], capacity the key bucket of the tokens written; the written length kept
    twice, on the host (`length`: when to grow) and on the device (`cumulative_length`: where to write)."""

    # Its capacity grows: a graph compiled over it would be specialised on it (generate compiles only compileable
    # caches).
    is_compileable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.length = 0
        self.cumulative_length = torch.zeros((), dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_zeros((*key_states.shape[:2], 0, key_states.shape[-1]))
        self.values = value_states.new_zeros((*value_states.shape[:2], 0, value_states.shape[-1]))
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        capacity = key_bucket(self.length + new)
        if capacity > self.keys.shape[-2]:
            self.keys, self.values = _grown(self.keys, capacity), _grown(self.values, capacity)
        positions = torch.arange(new, device=self.device) + self.cumulative_length
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        self.cumulative_length.add_(new)
        self.length += new
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The capacity this step's update will leave (the keys attention gets), at offset 0."""
        return key_bucket(self.length + query_length), 0

    def get_seq_length(self):
        return self.cumulative_length if self.is_initialized else 0

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -`tokens_to_remove` tokens (a negative int, as transformers asks): the next update writes
        over them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        removed = min(-tokens_to_remove, self.length)
        if removed and self.is_initialized:
            self.cumulative_length.sub_(removed)
            self.length -= removed


def _grown(tensor: torch.Tensor, capacity: int) -> torch.Tensor:
    """`tensor` [B, H, S, D] with zero rows appended along S up to `capacity`."""
    return torch.nn.functional.pad(tensor, (0, 0, 0, capacity - tensor.shape[-2]))


class BucketedDynamicCache(DynamicCache):
    """DynamicCache(config=...) with `BucketedLayer` for its full-attention layers (module docstring)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.layers = [BucketedLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]
