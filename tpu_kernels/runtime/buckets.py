"""Shape buckets: the few static sizes a kernel compiles for, whatever the prompt.

Shipped into every built kernel as `_buckets.py` (as the binding is shipped as
`_binding.py`); standard library only. A kernel pads a size to its bucket, runs
on the padded arrays with lengths or masks that hide the padding, and slices the
result back, so each kernel compiles once per bucket instead of once per prompt
length or per generated token (on a TPU each new shape is a Mosaic compile of
0.5 to 8 s on the host).

Two kinds of size, two ladders:

- Token counts (`token_bucket`): rows fed to RMSNorm and the experts layer, the
  query length of attention. Powers of two from 16 up to 512, then steps of 512.
  This is vLLM's TPU ladder (tpu-inference `get_token_paddings(min_token_size=16,
  max_token_size, padding_gap)`: double while at most `padding_gap`, then add
  `padding_gap`), with a gap of 512: below 512 rows a kernel is bound by weight
  traffic and fixed cost, so doubling costs little; above it, padding at most 512
  rows keeps the waste under a step of a long prefill. 16 is a whole bf16
  sublane tile (16 rows of 2 bytes), so a decode step of 1 to 16 tokens shares
  one program.
- Key lengths (`key_bucket`): the KV length attention sees. Multiples of 128
  (a lane tile, the DMA block of the attention kernels and the page size serving
  engines use), first consecutive ones up to 512 as torch_tpu's compile backend
  does (`num_dynamic_buckets` buckets of `bucket_size=128`), then half-octave
  steps (768, 1024, 1536, 2048, 3072, ...). Every bucket is at least 128 wide,
  so generating 128 tokens from any prompt crosses at most one bucket edge (the
  attention kernel sees at most two key shapes), and padding adds at most half
  of the real keys beyond 512 (at most 127 keys below it).
"""

from __future__ import annotations

MIN_TOKEN_BUCKET = 16
TOKEN_BUCKET_GAP = 512
KEY_BUCKET_STEP = 128
KEY_BUCKET_LINEAR_UNTIL = 512


def _check_size(n: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{what} must be at least 1, got {n}")


def token_bucket(n: int) -> int:
    """The smallest token bucket that holds `n` tokens (rows, query length)."""
    _check_size(n, "token count")
    if n <= TOKEN_BUCKET_GAP:
        bucket = MIN_TOKEN_BUCKET
        while bucket < n:
            bucket *= 2
        return bucket
    return -(-n // TOKEN_BUCKET_GAP) * TOKEN_BUCKET_GAP


def key_bucket(n: int) -> int:
    """The smallest key-length bucket that holds `n` keys: a multiple of 128."""
    _check_size(n, "key length")
    if n <= KEY_BUCKET_LINEAR_UNTIL:
        return -(-n // KEY_BUCKET_STEP) * KEY_BUCKET_STEP
    octave = KEY_BUCKET_LINEAR_UNTIL
    while True:
        for bucket in (octave * 3 // 2, octave * 2):
            if n <= bucket:
                return bucket
        octave *= 2


def _ladder(bucket_of, max_size: int) -> list[int]:
    buckets = [bucket_of(1)]
    while buckets[-1] < max_size:
        buckets.append(bucket_of(buckets[-1] + 1))
    return buckets


def token_buckets(max_tokens: int) -> list[int]:
    """Every token bucket up to and including the one that holds `max_tokens`."""
    _check_size(max_tokens, "max_tokens")
    return _ladder(token_bucket, max_tokens)


def key_buckets(max_keys: int) -> list[int]:
    """Every key-length bucket up to and including the one that holds `max_keys`."""
    _check_size(max_keys, "max_keys")
    return _ladder(key_bucket, max_keys)
