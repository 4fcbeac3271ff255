"""bf16 rows as int32 words, two columns per word: the form a kernel can copy one row at a time.

Mosaic tiles a bf16 array in VMEM with two rows per 32-bit word, so a DMA
moves bf16 rows only in pairs; 32-bit rows it moves one by one. The grouped
matmul writes its rows this way for the combine kernel to copy
(`MatmulProblem.packed_out`), and reads token rows this way to copy them
(`MatmulProblem.gathered`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def pack_rows(values: jax.Array, split: int | None = None) -> jax.Array:
    """f32 or bf16 `[rows, cols]` rounded to bf16 and packed as int32 words `[rows, split]`: column j's bits in the
    low half, column split + j's (zero past the columns) in the high half (32-bit operations only: Mosaic's bf16
    values have no bitcast). `split` (default cols / 2) is at least half the columns: past half, the second
    half's columns can start on an MXU pass (`gmm.plan.gathered_plan`)."""
    split = values.shape[1] // 2 if split is None else split
    if values.shape[1] < 2 * split:
        values = jnp.pad(values, ((0, 0), (0, 2 * split - values.shape[1])))

    # Sliced before the bitcasts: XLA then packs in one pass; bitcasting the whole first, it writes and rereads
    # an int32 copy of all the rows wherever it leaves that copy in HBM (v5p).
    return pack_first_half(values[:, :split]) | pack_second_half(values[:, split:])


def _bf16_bits(values: jax.Array) -> jax.Array:
    """Values rounded to bf16, as the int32 bits of that bf16 widened to f32 (its bits in the high half)."""
    return lax.bitcast_convert_type(values.astype(jnp.bfloat16).astype(jnp.float32), jnp.int32)


def pack_first_half(values: jax.Array) -> jax.Array:
    """The words' low halves: `values` rounded to bf16, their bits in the low 16 bits, zeros above."""
    return lax.shift_right_logical(_bf16_bits(values), 16)


def pack_second_half(values: jax.Array) -> jax.Array:
    """The words' high halves: `values` rounded to bf16, their bits in the high 16 bits, zeros below."""
    return _bf16_bits(values) & jnp.int32(-65536)


def unpack_rows(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`pack_rows`'s words as the two f32 halves of the columns they hold, exactly (the second zero-padded to the
    first's width)."""
    first = lax.bitcast_convert_type(lax.shift_left(words, 16), jnp.float32)
    second = lax.bitcast_convert_type(words & jnp.int32(-65536), jnp.float32)
    return first, second
