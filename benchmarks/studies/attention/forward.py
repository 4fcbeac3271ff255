"""The forward kernels: bytes and MXU work of their grids against the minimum, skipped blocks, modelled time,
and the v6e compile's cost against XLA's attention (the package docstring says how)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks import perf
from tpu_kernels.aot import compile_for
from tpu_kernels.runtime.hardware import resolve_target
from benchmarks.studies import calibration_bands
from benchmarks.studies.model_shapes import ATTENTION_HEADS, ATTENTION_WINDOWS
from benchmarks.studies.relayouts import relayout_fields, relayouts


GENERATIONS = ("v5e", "v5p", "v6e", "tpu7x")
COST_GENERATION = "v6e"
DECODE_TARGET_RATIO = 1.1
QWEN3 = ATTENTION_HEADS["qwen3-30b-a3b"]
GPT_OSS = ATTENTION_HEADS["gpt-oss-20b"]
GEMMA_4_SLIDING = ATTENTION_HEADS["gemma-4-26b-a4b sliding"]
# Below this many µs a relayout rounds to 0 µs in the tables and is left out of them and of the summary: at head_dim
# 128 and up the only copies are the kernel's scalar operands staged into SMEM (nanoseconds).
RELAYOUT_SHOWN_FROM_US = 0.5


@dataclasses.dataclass(frozen=True)
class Shape:
    label: str
    batch: int
    q_len: int
    kv_len: int
    q_heads: int = QWEN3["q_heads"]
    kv_heads: int = QWEN3["kv_heads"]
    head_dim: int = QWEN3["head_dim"]
    causal: bool = True
    sliding_window: int | None = None
    kv_lengths: tuple[int, ...] | None = None
    decode_target: bool = False  # counts towards the <= 1.1x decode target

    @property
    def kind(self) -> str:
        return "decode" if self.q_len == 1 else "prefill"


SHAPES = [
    Shape("prefill B=1 S=1024", 1, 1024, 1024),
    Shape("prefill B=1 S=4096", 1, 4096, 4096),
    Shape("prefill B=1 S=4096 non-causal", 1, 4096, 4096, causal=False),
    Shape("prefill B=1 S=8192", 1, 8192, 8192),
    Shape("chunked prefill B=1 512 new vs 4096 cached", 1, 512, 4608),
    Shape(f"prefill B=1 S=8192 window={ATTENTION_WINDOWS['gemma-4-26b-a4b sliding']} (gemma-like)", 1, 8192, 8192,
          sliding_window=ATTENTION_WINDOWS["gemma-4-26b-a4b sliding"], **GEMMA_4_SLIDING),
    Shape("decode B=1 cache=4096", 1, 1, 4096, decode_target=True),
    Shape("decode B=8 cache=4096", 8, 1, 4096, decode_target=True),
    Shape("decode B=64 cache=4096", 64, 1, 4096, decode_target=True),
    Shape("decode B=1 cache=32768", 1, 1, 32768, decode_target=True),
    Shape("decode B=8 cache=32768", 8, 1, 32768, decode_target=True),
    Shape("decode B=8 static cache=32768, lengths 1k..32k", 8, 1, 32768,
          kv_lengths=(1000, 4096, 7000, 12000, 16384, 20000, 30000, 32768)),
    Shape("decode B=8 cache=32768 window=4096", 8, 1, 32768, sliding_window=4096),
    Shape(f"prefill B=1 S=4096 window={ATTENTION_WINDOWS['gpt-oss-20b']} D={GPT_OSS['head_dim']} (gpt-oss-like)", 1,
          4096, 4096, sliding_window=ATTENTION_WINDOWS["gpt-oss-20b"], **GPT_OSS),
    Shape(f"decode B=8 cache=4096 D={GPT_OSS['head_dim']} (gpt-oss-like)", 8, 1, 4096, **GPT_OSS),
]
QUICK = {"prefill B=1 S=4096", "decode B=8 cache=4096", "decode B=8 cache=32768",
         "decode B=8 static cache=32768, lengths 1k..32k"}


def q_offsets(shape: Shape) -> np.ndarray:
    return np.full(shape.batch, shape.kv_len - shape.q_len, np.int64)


def live_lengths(shape: Shape) -> np.ndarray:
    if shape.kv_lengths is None:
        return np.full(shape.batch, shape.kv_len, np.int64)
    return np.asarray(shape.kv_lengths, np.int64)


def visible_key_ranges(reference, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
    """Per (batch, query): first and last visible key (last < first: none), from the reference's own mask.

    The reference mask is built row-chunk by row-chunk so that 8192 x 8192 stays small.
    """
    from_reference = []
    for b in range(shape.batch):
        firsts, lasts = [], []
        for start in range(0, shape.q_len, 512):
            rows = min(512, shape.q_len - start)
            mask = reference_mask(reference, shape, b, start, rows)  # [rows, kv_len]
            any_visible = mask.any(axis=1)
            first = np.where(any_visible, mask.argmax(axis=1), shape.kv_len)
            last = np.where(any_visible, shape.kv_len - 1 - mask[:, ::-1].argmax(axis=1), -1)
            firsts.append(first)
            lasts.append(last)
        from_reference.append((np.concatenate(firsts), np.concatenate(lasts)))
    return np.stack([f for f, _ in from_reference]), np.stack([l for _, l in from_reference])


def reference_mask(reference, shape: Shape, b: int, start: int, rows: int) -> np.ndarray:
    offset = int(q_offsets(shape)[b]) + start
    lengths = torch.tensor([int(live_lengths(shape)[b])], dtype=torch.int32)
    mask = reference.visibility_mask(
        1, rows, shape.kv_len, causal=shape.causal, q_offset=offset, kv_lengths=lengths,
        sliding_window=shape.sliding_window,
    )
    # visibility_mask places the queries at offset..offset+rows-1 of a kv_len-long cache.
    return mask[0, 0].numpy()


def needed_tiles(first: np.ndarray, last: np.ndarray, shape: Shape, block_q: int, block_kv: int) -> np.ndarray:
    """bool [batch, q_blocks, kv_blocks]: tiles with at least one visible (query, key) pair."""
    num_q_blocks = -(-shape.q_len // block_q)
    num_kv_blocks = -(-shape.kv_len // block_kv)
    tiles = np.zeros((shape.batch, num_q_blocks, num_kv_blocks), bool)
    for b in range(shape.batch):
        for qi in range(num_q_blocks):
            rows = slice(qi * block_q, min((qi + 1) * block_q, shape.q_len))
            for f, l in zip(first[b, rows], last[b, rows]):
                if l >= f:
                    tiles[b, qi, f // block_kv : l // block_kv + 1] = True
    return tiles


def visible_pairs(first: np.ndarray, last: np.ndarray) -> int:
    return int(np.clip(last - first + 1, 0, None).sum())


def visible_keys(first: np.ndarray, last: np.ndarray) -> int:
    """Keys some query sees, summed over the batch (visible keys form one interval per sequence)."""
    any_visible = last >= first
    lo = np.where(any_visible, first, np.iinfo(np.int64).max).min(axis=1)
    hi = np.where(any_visible, last, -1).max(axis=1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def minimum_bytes(shape: Shape, keys: int, itemsize: int) -> int:
    q_and_out = 2 * shape.batch * shape.q_heads * shape.q_len * shape.head_dim * itemsize
    return q_and_out + 2 * shape.kv_heads * keys * shape.head_dim * itemsize


def kernel_fn(built, shape: Shape, generation: str):
    def attention(q, key, value, kv_lengths):
        return built.flash.kernel.differentiable_flash_attention(
            q, key, value, causal=shape.causal, sliding_window=shape.sliding_window,
            kv_lengths=kv_lengths, generation=generation,
        )

    return attention


def xla_attention(shape: Shape):
    """Plain jnp attention (materialised logits), compiled by XLA: the baseline."""

    def attention(q, key, value, kv_lengths):
        group = shape.q_heads // shape.kv_heads
        key = jnp.repeat(key, group, axis=1)
        value = jnp.repeat(value, group, axis=1)
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, key, preferred_element_type=jnp.float32) * shape.head_dim**-0.5
        query_pos = (shape.kv_len - shape.q_len) + jnp.arange(shape.q_len)[:, None]
        key_pos = jnp.arange(shape.kv_len)[None, :]
        visible = (key_pos[None] < kv_lengths[:, None, None])[:, None]
        if shape.causal:
            visible = visible & (key_pos <= query_pos)
        if shape.sliding_window is not None:
            visible = visible & (key_pos > query_pos - shape.sliding_window)
        weights = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bhkd->bhqd", weights.astype(value.dtype), value)

    return attention


def avals(shape: Shape, dtype):
    q = jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.q_len, shape.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((shape.batch, shape.kv_heads, shape.kv_len, shape.head_dim), dtype)
    return q, kv, kv


def program_avals(shape: Shape, dtype):
    """`kernel_fn`'s arguments as a user's call hands them over: q, k, v and the lengths, all device arrays."""
    return [*avals(shape, dtype), jax.ShapeDtypeStruct((shape.batch,), jnp.int32)]


def cost_summary(compiled) -> dict:
    cost = compiled.cost_analysis() or {}
    keep = {"flops": "flops", "transcendentals": "transcendentals", "bytes accessed": "bytes_accessed"}
    return {name: cost[key] for key, name in keep.items() if key in cost}


def active_steps_from_prefetch(num_q_blocks: int):
    """Mirror of the kernel's `pl.when`: step (b, h, qi, s) computes KV block lo + s iff lo + s <= hi.

    lo / hi (per batch and q block) are the kernel's third and fourth scalar-prefetch operands.
    """

    def active(_name, grid_indices, prefetch):
        lo, hi = prefetch[2], prefetch[3]
        b, qi, kv_step = grid_indices[:, 0], grid_indices[:, 2], grid_indices[:, 3]
        slot = b * num_q_blocks + qi
        return lo[slot] + kv_step <= hi[slot]

    return active


@dataclasses.dataclass(frozen=True)
class Visible:
    """What the reference's mask lets a shape's queries see, and the least work and bytes that takes."""

    first: np.ndarray  # [batch, q_len]: each query's first visible key
    last: np.ndarray  # [batch, q_len]: its last (last < first: none)
    pairs: int  # visible (query, key) pairs per head
    keys: int  # keys some query sees, summed over the batch
    min_bytes: int
    useful_flops: int


def visible_work(reference, shape: Shape, dtype) -> Visible:
    """The shape's `Visible`, from the reference's own mask."""
    first, last = visible_key_ranges(reference, shape)
    pairs = visible_pairs(first, last)
    keys = visible_keys(first, last)
    return Visible(
        first=first,
        last=last,
        pairs=pairs,
        keys=keys,
        min_bytes=minimum_bytes(shape, keys, jnp.dtype(dtype).itemsize),
        # pairs is summed over the batch already.
        useful_flops=4 * shape.q_heads * pairs * shape.head_dim,
    )


def measure_generation(built, shape: Shape, dtype, generation: str, visible: Visible, relayout=None) -> dict:
    """The forward's tiles, grid, traffic and modelled time on one generation, against the visible work.

    `relayout`: the probe (`bench.relayouts.relayouts`) of the program a user's call compiles around the
    kernel; its copies are added to the time, outside the calibrated band. None: not probed, said in the row.
    """
    itemsize = jnp.dtype(dtype).itemsize
    min_bytes, useful_flops = visible.min_bytes, visible.useful_flops
    problem = built.Problem.of_shape(
        q_heads=shape.q_heads, kv_heads=shape.kv_heads, q_len=shape.q_len, kv_len=shape.kv_len,
        head_dim=shape.head_dim, dtype=dtype, sliding_window=shape.sliding_window,
    )
    config = built.flash.tiles.select(problem, resolve_target(generation))
    block_q = 1 if shape.q_len == 1 else config.block_q
    num_q_blocks = -(-shape.q_len // block_q)
    calls = perf.model_pallas_traffic(
        kernel_fn(built, shape, generation), *avals(shape, dtype), live_lengths(shape).astype(np.int32),
        active_steps=active_steps_from_prefetch(num_q_blocks),
    )
    (call,) = calls
    modelled = perf.roofline(calls, generation, min_bytes=min_bytes, min_flops=useful_flops)
    tiles = needed_tiles(visible.first, visible.last, shape, block_q, config.block_kv)
    # A decode step handles kv_heads_per_step KV heads at once.
    head_steps = shape.kv_heads // (config.kv_heads_per_step if shape.kind == "decode" else 1)
    needed_steps = int(tiles.sum()) * head_steps
    # Inputs in order: q, k, v (after the four scalar-prefetch operands).
    query_op, key_op, value_op = call.inputs
    key_fetches = key_op.transfers
    visible_kv_bytes = 2 * shape.kv_heads * visible.keys * shape.head_dim * itemsize
    # A (b, h, q block) with nothing visible still holds one clamped block in the pipeline.
    empty_rows = int((~tiles.any(axis=2)).sum()) * head_steps
    charged = relayout_fields(relayout)
    relayout_s = (charged["relayout_us"] or 0.0) * 1e-6
    time_s = modelled.pipelined_time_s + relayout_s
    return {
        "block_q": block_q,
        "block_kv": config.block_kv,
        "kv_heads_per_step": config.kv_heads_per_step if shape.kind == "decode" else 1,
        "vmem_limit_bytes": config.vmem_limit_bytes,
        "grid": list(call.grid),
        "grid_steps": call.steps,
        "computed_steps": call.active_steps,
        "needed_steps": needed_steps,
        "skips_all_masked_blocks": call.active_steps == needed_steps,
        "k_block_fetches": key_fetches,
        "q_block_fetches": query_op.transfers,
        # At most one fetch per needed tile (consecutive tiles of one block share a fetch), plus the one
        # block a (b, h, q block) with nothing visible parks on: no fully masked block is fetched.
        "fetches_only_needed_blocks": key_fetches <= needed_steps + empty_rows,
        "hbm_read_bytes": call.hbm_read_bytes,
        "hbm_write_bytes": call.hbm_write_bytes,
        "hbm_bytes": call.hbm_bytes,
        "bytes_ratio": call.hbm_bytes / min_bytes,
        "kv_passes": (key_op.hbm_bytes + value_op.hbm_bytes) / visible_kv_bytes,
        "mxu_flops": call.mxu_flops(generation),
        "flops_ratio": call.mxu_flops(generation) / useful_flops,
        "pipeline_buffers_vmem_bytes": call.vmem_bytes,
        "fits_vmem": modelled.fits_vmem,
        # Headline: the calibrated pipelined figure (module docstring) plus XLA's relayout copies around the call.
        "modelled_time_us": time_s * 1e6,
        "kernel_time_us": modelled.pipelined_time_s * 1e6,
        **charged,
        # The band covers the kernel's calibrated error; the relayout copies are uncalibrated XLA ops.
        **calibration_bands.p90_fields(calibration_bands.band({"flash_attention": modelled.pipelined_time_s},
                                                              generation, modelled.regime, uncalibrated_s=relayout_s)),
        "overlap_time_us": (modelled.time_s + relayout_s) * 1e6,
        "roofline_us": modelled.roofline_s * 1e6,
        "pct_of_roofline": 100.0 * modelled.roofline_s / time_s,
        "overlap_pct_of_roofline": 100.0 * modelled.roofline_s / (modelled.time_s + relayout_s),
        "bound": modelled.bound,
    }


# The prefill tiles the forward sweep replays (`sweep_forward`): the windowed shapes' candidates.
SWEEP_BLOCKS = {"block_q": (128, 256, 512), "block_kv": (128, 256, 512, 1024)}


def sweep_forward(built, shape: Shape, dtype, generation: str) -> dict:
    """Pipelined time of every (block_q, block_kv) of SWEEP_BLOCKS whose working set fits the VMEM budget at a
    prefill shape; the best, and the tiles `select` picks for the shape, with their time."""
    problem = built.Problem.of_shape(q_heads=shape.q_heads, kv_heads=shape.kv_heads, q_len=shape.q_len,
                                     kv_len=shape.kv_len, head_dim=shape.head_dim, dtype=dtype,
                                     sliding_window=shape.sliding_window)
    target = resolve_target(generation)
    selected = built.flash.tiles.select(problem, target)
    rows = []
    for block_q in SWEEP_BLOCKS["block_q"]:
        for block_kv in SWEEP_BLOCKS["block_kv"]:
            working_set = built.flash.tiles.vmem_bytes(problem, built.flash.tiles.ForwardTiles(block_q, block_kv))
            if working_set > built.vmem_budget(target):
                continue
            config = built.AttentionConfig(block_q=block_q, block_kv=block_kv,
                                           vmem_limit_bytes=built.vmem_limit(working_set, target))
            rows.append({"block_q": block_q, "block_kv": block_kv,
                         "pipelined_us": round(_pipelined_us(built, shape, dtype, generation, config), 1)})
    best = min(rows, key=lambda row: row["pipelined_us"])
    chosen = {"block_q": selected.block_q, "block_kv": selected.block_kv,
              "pipelined_us": round(_pipelined_us(built, shape, dtype, generation, selected), 1)}
    return {"best": best, "selected": chosen, "selected_over_best": round(chosen["pipelined_us"] / best["pipelined_us"], 3),
            "rows": rows}


def _pipelined_us(built, shape: Shape, dtype, generation: str, config) -> float:
    def attention(q, key, value, kv_lengths):
        return built.flash.kernel.differentiable_flash_attention(
            q, key, value, causal=shape.causal, sliding_window=shape.sliding_window, kv_lengths=kv_lengths,
            generation=generation, config=config)

    calls = perf.model_pallas_traffic(attention, *avals(shape, dtype), live_lengths(shape).astype(np.int32),
                                      active_steps=active_steps_from_prefetch(-(-shape.q_len // config.block_q)))
    return perf.roofline(calls, generation).pipelined_time_s * 1e6


def measure(built, shape: Shape, dtype) -> dict:
    visible = visible_work(built.reference, shape, dtype)
    entry = {
        "label": shape.label,
        "kind": shape.kind,
        "batch": shape.batch,
        "q_len": shape.q_len,
        "kv_len": shape.kv_len,
        "q_heads": shape.q_heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "causal": shape.causal,
        "sliding_window": shape.sliding_window,
        "kv_lengths": None if shape.kv_lengths is None else list(shape.kv_lengths),
        "dtype": jnp.dtype(dtype).name,
        "visible_pairs_per_head": visible.pairs,
        "useful_flops": visible.useful_flops,
        "visible_keys": visible.keys,
        "min_bytes": visible.min_bytes,
        "per_generation": {
            generation: measure_generation(built, shape, dtype, generation, visible,
                                           relayouts(kernel_fn(built, shape, generation), program_avals(shape, dtype),
                                                     generation))
            for generation in GENERATIONS
        },
    }
    args = program_avals(shape, dtype)
    compiled = compile_for(kernel_fn(built, shape, COST_GENERATION), args, COST_GENERATION)
    entry[f"{COST_GENERATION}_cost_analysis"] = cost_summary(compiled)
    entry[f"{COST_GENERATION}_xla_reference_cost_analysis"] = cost_summary(
        compile_for(xla_attention(shape), args, COST_GENERATION)
    )
    return entry


def summarise(results: list[dict]) -> dict:
    decode = [e for e in results if e["label"] in {s.label for s in SHAPES if s.decode_target}]
    worst_decode = max((e["per_generation"][g]["bytes_ratio"] for e in decode for g in GENERATIONS), default=None)
    skips = all(e["per_generation"][g]["skips_all_masked_blocks"] for e in results for g in GENERATIONS)
    fetches = all(e["per_generation"][g]["fetches_only_needed_blocks"] for e in results for g in GENERATIONS)
    return {
        "relayout_charged_us": relayouts_shown(results),
        "decode_target_bytes_ratio": DECODE_TARGET_RATIO,
        "worst_decode_bytes_ratio_full_cache": worst_decode,
        "meets_decode_target": worst_decode is not None and worst_decode <= DECODE_TARGET_RATIO,
        "skips_all_fully_masked_blocks": skips,
        "fetches_no_fully_masked_block": fetches,
        "note": (
            "bytes_ratio = bytes the grid moves / (q read once + out written once + the k, v rows some query "
            "can see read once: up to each sequence's length, inside the sliding window). Prefill re-reads K/V once per query block by design (kv_passes), so its ratio "
            "is above 1 and its time is MXU-bound. needed_steps counts tiles with a visible pair from the "
            "float64 reference's mask; computed_steps mirrors the kernel's pl.when on its scalar-prefetched "
            "block ranges; k_block_fetches comes from replaying the clamped index maps. relayout_charged_us: the "
            "copies XLA makes of the kernel's arguments into its layout and of out back (at head_dim 64 none: q, "
            "K, V and out are read and written sequence-minor, as XLA stores them), per shape and generation, where "
            "any are made (included in modelled_time_us)."
        ),
    }


def relayouts_shown(results: list[dict]) -> dict:
    """{label: {generation: relayout µs}} of the shapes whose relayout reaches RELAYOUT_SHOWN_FROM_US on some
    generation (at these sizes: the shapes whose program copies an activation)."""
    found = {}
    for entry in results:
        charged = {g: round(entry["per_generation"][g]["relayout_us"] or 0.0, 1) for g in GENERATIONS}
        if max(charged.values()) >= RELAYOUT_SHOWN_FROM_US:
            found[entry["label"]] = charged
    return found
