"""The rivals: megablox's, vLLM's (its TPU backend's gmm), tokamax's and XLA's grouped matmuls, each in the experts
layer a user writes, and the configs searched for the tiled ones.

The compile cache keys a layer by its lowered text, which names the jitted function (`jit_user_layer`):
renaming `user_layer` would miss every cached compile of the rivals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from benchmarks.perf import tokamax_kernels
from tpu_kernels.runtime.hardware import default_layout_swaps_minor_dims, round_up, tpu_generation

from .shapes import Model


TOKAMAX_MIN_ROWS = 128  # tokamax's op refuses lhs or rhs dimensions below 128
ROW_TILES = (128, 256, 512, 1024)
# The rivals' blocks searched on TPU7x, whose default scoped VMEM limit has no fixed edge (runtime/hardware.py:
# double-buffered blocks of 34 MiB in all compile there, of 36 MiB with larger blocks): 32 MiB, v6e's default.
TPU7X_SCOPED_VMEM_BYTES = 32 << 20


def split(x: jax.Array, model: Model) -> tuple[jax.Array, jax.Array]:
    """The gate and up halves of a `[rows, 2I]` array: even / odd columns (interleaved) or first / second half."""
    if model.interleaved:
        return x[:, 0::2], x[:, 1::2]
    return tuple(jnp.split(x, 2, axis=-1))


def gate(gate_part: jax.Array, up: jax.Array, model: Model) -> jax.Array:
    """The gated intermediate from the f32 gate and up projections, as the model's experts compute it."""
    if model.activation == "clamped_swiglu":
        gate_part = jnp.minimum(gate_part, model.limit)
        up = jnp.clip(up, -model.limit, model.limit)
        return (up + 1.0) * gate_part * jax.nn.sigmoid(gate_part * model.alpha)
    if model.activation == "gelu_tanh":
        return jax.nn.gelu(gate_part, approximate=True) * up
    return jax.nn.silu(gate_part) * up


def stored_order(model: Model, projection: str) -> tuple[bool, bool]:
    """(swap, transpose_rhs): how a layer reads `projection`'s weights in the order XLA stores them.

    transformers' `[E, N, K]` (`[E, K, N]` when transposed) is read as given,
    or, where XLA's default TPU layout keeps the last two dims swapped
    (`default_layout_swaps_minor_dims`: Gemma 4's down_proj), as the swapped
    view: a bitcast instead of a relayout of all the weights per call. Ours
    does the same (`config.weights_orientation`).
    """
    h, i = model.hidden, model.intermediate
    out_in = {"gate_up": (2 * i, h), "down": (h, i)}[projection]
    given = out_in[::-1] if model.weights_transposed else out_in
    swap = default_layout_swaps_minor_dims(given)
    return swap, (not model.weights_transposed) != swap


def rival_order(rival: "Rival", model: Model, projection: str) -> tuple[bool, bool]:
    """(swap, transpose_rhs) of `projection`'s weights in `rival`'s layer: as stored (`stored_order`), or [E, K, N]
    as given for a rival that arranges its weights so at load time."""
    return (False, False) if rival.weights_k_n else stored_order(model, projection)


def user_layer(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias=None, down_bias=None, *,
               model: Model, rival: "Rival", configs):
    """The experts layer a user builds around a rival's grouped matmul (module docstring)."""
    rows, k = top_k_index.shape
    experts = gate_up.shape[0]
    (swap_gate_up, gate_up_transposed), (swap_down, down_transposed) = (
        rival_order(rival, model, "gate_up"), rival_order(rival, model, "down"))
    gate_up = jnp.swapaxes(gate_up, 1, 2) if swap_gate_up else gate_up
    down = jnp.swapaxes(down, 1, 2) if swap_down else down
    expert_ids = top_k_index.reshape(-1)
    order = jnp.argsort(expert_ids, stable=True)  # other ranks' picks (id == experts) sort last
    sizes = jnp.zeros(experts + 1, jnp.int32).at[expert_ids].add(1)[:experts]
    picks = rows * k
    bias_rows = jnp.minimum(expert_ids[order], experts - 1)
    projected = rival.padded_matmul(hidden[order // k], gate_up, sizes, gate_up_transposed, configs[0])
    # The glue ours uses (moe.grouped_experts): split before casting, biases split too, so XLA fuses it.
    gate_part, up = (part.astype(jnp.float32) for part in split(projected, model))
    if gate_up_bias is not None:
        gate_bias, up_bias = split(gate_up_bias, model)
        gate_part = gate_part + gate_bias[bias_rows].astype(jnp.float32)
        up = up + up_bias[bias_rows].astype(jnp.float32)
    intermediate = gate(gate_part, up, model).astype(hidden.dtype)
    out = rival.padded_matmul(intermediate, down, sizes, down_transposed, configs[1])
    # Each token gathers its picks' rows one pick slot at a time, weights and sums them (as ours); rows past
    # the groups hold whatever the kernel left there: masked before weighting.
    position = jnp.zeros_like(order).at[order].set(jnp.arange(picks, dtype=order.dtype)).reshape(rows, k)
    live = position < sizes.sum()
    pick_weights = jnp.where(live, top_k_weights.astype(jnp.float32), 0.0)
    pick_experts = jnp.minimum(top_k_index, experts - 1)
    result = jnp.zeros((rows, hidden.shape[1]), jnp.float32)
    for slot in range(k):
        picked = jnp.where(live[:, slot, None], out[position[:, slot]].astype(jnp.float32), 0.0)
        if down_bias is not None:
            picked = picked + down_bias[pick_experts[:, slot]].astype(jnp.float32)
        result = result + pick_weights[:, slot, None] * picked
    return result.astype(hidden.dtype)


def megablox_matmul(lhs, rhs, sizes, transpose_rhs, tiling):
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    return gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype, tiling=tuple(tiling), transpose_rhs=transpose_rhs)


def vllm_matmul(lhs, rhs, sizes, transpose_rhs, tiling):
    from .vllm_kernels import DEFAULT_FOLDER, load_gmm

    if transpose_rhs:
        raise ValueError("vLLM's gmm reads weights as [E, K, N] only (its layer arranges them so at load time)")
    return load_gmm(DEFAULT_FOLDER)(lhs, rhs, sizes, preferred_element_type=lhs.dtype, tiling=tuple(tiling))


def tokamax_matmul(lhs, rhs, sizes, transpose_rhs, tiling):
    from jax import lax
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu_kernel as tokamax_kernel

    # tiling: (tile_m, tile_k, tile_n) with 2 input buffers, or with the buffer count as a fourth value.
    buffers = tiling[3] if len(tiling) > 3 else 2
    return tokamax_kernel.gmm(
        lhs, rhs, sizes, precision=(lax.Precision.DEFAULT, lax.Precision.DEFAULT), out_dtype=lhs.dtype,
        tiling=tuple(tiling[:3]), input_buffer_count=buffers, transpose_rhs=transpose_rhs,
    )


def xla_matmul(lhs, rhs, sizes, transpose_rhs, config):
    from jax import lax

    del config
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2 if transpose_rhs else 1,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    return lax.ragged_dot_general(lhs, rhs, sizes, dims, preferred_element_type=lhs.dtype)


@dataclasses.dataclass(frozen=True)
class Rival:
    name: str
    matmul: object  # matmul(lhs, rhs, sizes, transpose_rhs, tiling) -> [rows, N]
    min_rows: int  # rows the kernel accepts at least
    tiled: bool  # has a tiling config (XLA has none)
    # Reads every projection's weights as [E, K, N], arranged once at load time as vLLM's loader does: its layer
    # takes them so (`Case.avals(weights_k_n=True)`), at no cost per call. vLLM's gmm has no transposed read; XLA's
    # ragged dot has one, but XLA leaves that loop's bounds empty and the model cannot price it
    # (`benchmarks.perf.xla_ragged_dot`), so the XLA rival is priced at the arrangement whose loop it can read.
    weights_k_n: bool = False

    def padded_rows(self, rows: int, tiling) -> int:
        """The lhs rows a caller must pass: megablox and tokamax need a multiple of the row tile."""
        if not self.tiled:
            return rows
        return round_up(max(rows, self.min_rows), tiling[0])

    def padded_matmul(self, lhs, rhs, sizes, transpose_rhs, tiling):
        rows = lhs.shape[0]
        padded = self.padded_rows(rows, tiling)
        if padded != rows:
            lhs = jnp.pad(lhs, ((0, padded - rows), (0, 0)))
        return self.matmul(lhs, rhs, sizes, transpose_rhs, tiling)[:rows]

    def replay_context(self):
        """tokamax's grid as a plain pallas_call, so perf's replay sees it (`benchmarks.perf.tokamax_kernels`)."""
        return tokamax_kernels.grid_as_pallas_call() if self.name == "tokamax" else contextlib.nullcontext()

    def lowering_lock(self):
        """Lowerings of tokamax code must not interleave with a replay under its patch."""
        return tokamax_kernels.TOKAMAX_LOCK if self.name == "tokamax" else contextlib.nullcontext()


RIVALS = {
    "megablox": Rival("megablox", megablox_matmul, 8, True),
    "vllm_gmm": Rival("vllm_gmm", vllm_matmul, 8, True, weights_k_n=True),
    "tokamax": Rival("tokamax", tokamax_matmul, TOKAMAX_MIN_ROWS, True),
    "xla_ragged_dot": Rival("xla_ragged_dot", xla_matmul, 1, False, weights_k_n=True),
}


def rival_layer(rival: Rival, model: Model, tilings):
    return functools.partial(user_layer, model=model, rival=rival, configs=tilings)


def tokamax_tile_space(dim: int) -> set[int]:
    """tokamax's own autotuning values for a K or N tile (its `_get_autotuning_configs`)."""
    rounded = round_up(dim, 128)
    return {128 * 2**i for i in range(8) if 128 * 2**i <= rounded} | {rounded // 2**i for i in range(6)} | {dim}


def block_vmem_bytes(tiling) -> int:
    """Double-buffered lhs, rhs and out blocks (bf16) and the f32 accumulator of a megablox-style kernel."""
    tm, tk, tn = tiling
    return 2 * (tm * tk + tk * tn + tm * tn) * 2 + tm * tn * 4


def block_splits(dim: int, parts: tuple[int, ...], floor: int) -> list[int]:
    """`dim` whole and split in `parts` (rounded up to a multiple of 128), those of at least `floor`."""
    return sorted({dim} | {split for split in (round_up(-(-dim // p), 128) for p in parts) if split >= floor},
                  reverse=True)


def rival_blocks(rival: Rival, k: int, n: int) -> tuple[list[int], list[int]]:
    """The K and N blocks searched for `rival`: ours' breadth (`our_tiles.candidates`: K whole and halved, N
    whole, halved and quartered) within what each kernel takes.

    K whole, halved and quartered down to 256, N whole, halved and quartered
    (N blocks are what a megacore splits for megablox and vLLM's gmm: their
    grids' "parallel" axis is N's, `perf.grid_replay`). tokamax: only the
    lowerable values of its own autotuning space, the largest four each.
    vLLM: K blocks, whole to eighths, that divide K (its gmm takes the whole
    K otherwise), and N also in eighths. Each holds the earlier search's
    blocks.
    """
    if rival.name == "tokamax":
        # Its space also holds non-multiples of 128 (K / 2 of an unaligned K), which Pallas cannot lower
        # unless they span the whole dimension.
        def lowerable(values, dim):
            return sorted({v for v in values if v >= 256 and (v % 128 == 0 or v == dim)}, reverse=True)[:4]

        return lowerable(tokamax_tile_space(k), k), lowerable(tokamax_tile_space(n), n)
    if rival.name == "vllm_gmm":
        return ([k] + [k // parts for parts in (2, 4, 8) if k % parts == 0 and (k // parts) % 128 == 0],
                block_splits(n, (2, 4, 8), 128))
    return block_splits(k, (2, 4), 256), block_splits(n, (2, 4), 128)


def largest_fitting(row_tile: int, tiles_k: list[int], tiles_n: list[int], limit: int) -> list[tuple[int, int, int]]:
    """At `row_tile`, per N block the largest K block whose blocks fit `limit`.

    The search's bound: N blocks are what a megacore splits (megablox's and
    vLLM's grids declare N's axis "parallel") and what decide how often the
    rows are read; with the N block fixed, a smaller K block than the largest
    that fits moves the same bytes in more grid steps. The largest blocks the
    earlier search kept are among these.
    """
    fitting = [(row_tile, tk, tn) for tk in tiles_k for tn in tiles_n
               if block_vmem_bytes((row_tile, tk, tn)) <= limit]
    return sorted({max(t for t in fitting if t[2] == tn) for _, _, tn in fitting}, reverse=True)


def candidate_tilings(rival: Rival, rows: int, k: int, n: int, generations: tuple[str, ...]) -> list[tuple[int, int, int]]:
    """The configs searched: per row tile, each N block of `rival_blocks` with the largest K block that fits
    (`largest_fitting`) the VMEM of one of `generations`, each priced per generation by the model as ours'
    candidates are (`tuning.tune_rival`).

    Row tiles 128 (the tiling a user picks, and vLLM's gmm_v2) to 1024
    (tokamax's own range ends there), at most the padded rows. The kernels
    keep Mosaic's default scoped VMEM limit (16 MiB on v5e and v5p, 32 MiB on
    v6e; TPU7x has no fixed one: TPU7X_SCOPED_VMEM_BYTES), so each
    generation's largest blocks are searched under its own limit, and a
    generation prices only those the model finds fit it. A config the
    compiler refuses inside the layer is replaced by the next best
    (`measure.variant`).
    """
    if not rival.tiled:
        return [None]
    limits = sorted({tpu_generation(g).default_scoped_vmem_bytes or TPU7X_SCOPED_VMEM_BYTES for g in generations})
    tiles_k, tiles_n = rival_blocks(rival, k, n)
    padded_rows = round_up(max(rows, rival.min_rows), 128)
    found = []
    for tm in ROW_TILES:
        if tm <= max(padded_rows, 128):
            for limit in limits:
                found += [tiling for tiling in largest_fitting(tm, tiles_k, tiles_n, limit) if tiling not in found]
    return found
