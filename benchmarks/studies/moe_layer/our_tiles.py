"""Ours tuned as the rivals are: a search over our grouped matmul's tiles at every prefill case, kept as data.

`python -m benchmarks moe_layer --all --tune-ours` replays ragged-dot's grouped
matmul (`grouped_matmul`) of each projection of each prefill case at
candidate tiles around its heuristic's (row tiles of 256 to 2048 rows, the
heuristic's N tile and the whole N, chunks of one MXU width) and prices each
standalone on the calibrated model per generation, as the rivals' search
does (`tuning.tune_rival`). A shape whose best candidate beats the heuristic
by at least MIN_GAIN is then checked in the layer as kernelize installs it
(compiled, with XLA's placements): bigger tiles ask for more VMEM, and XLA
then keeps fewer of the layer's operands on chip, which standalone pricing
cannot see. What also makes the layer faster goes into the kernel repo's
`tuned_tiles.json`, which `gmm.tiles.select` takes over the heuristic
at run time. The heuristic stays the fallback for every other shape. The
table changes no kernel code.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from tpu_kernels.runtime.hardware import LANES, resolve_target, round_up
from tpu_kernels.runtime.tuning import tuned_tiles

from .cache import Cache, Compiler, replay
from .modelling import standalone, timings
from .ours import ours_layer
from .rivals import stored_order
from .shapes import DTYPE, Case, projections

# The file in ragged-dot's package that holds the table (`gmm/tiles.py`'s TUNED_TILES_FILE), in the form of
# `tpu_kernels.runtime.tuning`.
TABLE = Path("torch-ext/ragged_dot_tpu/gmm/tuned_tiles.json")
# An entry is kept only where the search beats the heuristic by this share: below it the model's own
# error (p90 5.7 % on measured Pallas ragged dots) decides, and the heuristic is the simpler claim.
MIN_GAIN = 0.01
# The table's order: by the fields of ragged-dot's `TunedKey`, in its order.
TUNED_KEY_ORDER = ("generation", "m", "k", "n", "groups", "dtype", "rhs_dtype", "transpose_rhs")
ROW_TILES = (256, 512, 1024, 2048)


def candidates(built, key, generation: str) -> list:
    """Tiles to try for one grouped matmul `key` (a `TunedKey`): the heuristic's, other row tiles in chunks of
    one MXU width, the heuristic's N tile and its half, the whole N, its half and quarter, the heuristic's K tile
    and its halves down to 512 (smaller blocks expose less of the pipeline's first fetch and last write where the
    weights stream); those `check_config` accepts on `generation`."""
    problem = built.MatmulProblem(key.m, key.k, key.n, key.groups, key.dtype, key.rhs_dtype, key.transpose_rhs)
    target = resolve_target(generation)
    heuristic = built.gmm.tiles.heuristic_config(problem, target)
    chunk = target.mxu_size
    tile_ns = {heuristic.tile_n, key.n}
    for tile_n in (heuristic.tile_n // 2, key.n // 2, key.n // 4):
        if tile_n >= LANES and tile_n % LANES == 0:
            tile_ns.add(tile_n)
    tile_ks = {heuristic.tile_k}
    while min(tile_ks) // 2 >= 512:
        tile_ks.add(round_up(min(tile_ks) // 2, 256))
    found = [heuristic]
    for tile_m, tile_n, tile_k in itertools.product(ROW_TILES, sorted(tile_ns), sorted(tile_ks)):
        if tile_m < key.m:
            candidate = built.gmm.tiles.TileConfig(tile_m, tile_k, tile_n, chunk if tile_m > chunk else None)
            try:
                built.gmm.tiles.check_config(candidate, problem, target)
            except ValueError:
                continue
            if candidate not in found:
                found.append(candidate)
    return found


def _replay(built, cache: Cache, case: Case, key, tiles):
    experts = case.setting.local_experts
    lhs = jax.ShapeDtypeStruct((key.m, key.k), DTYPE)
    rhs = jax.ShapeDtypeStruct((experts, key.n, key.k) if key.transpose_rhs else (experts, key.k, key.n), DTYPE)
    fn = functools.partial(built.gmm.kernel.grouped_matmul, transpose_rhs=key.transpose_rhs,
                           zero_rows_past_groups=False, config=tiles)
    return replay(cache, lambda x, w, s, fn=fn: fn(x, w, s), (lhs, rhs, case.group_sizes))


def tune_case(built, cache: Cache, compiler: Compiler, case: Case, generations: tuple[str, ...]) -> list[dict]:
    """The table's entries for one case: per generation, the projections whose best tiles beat the heuristic by
    MIN_GAIN standalone and, together, make the layer faster."""
    return [entry for generation in generations
            for entry in kept_in_layer(built, cache, compiler, case, generation,
                                       standalone_winners(built, cache, case, generation))]


def projection_keys(built, case: Case, generation: str) -> list[tuple[str, object]]:
    """(projection, `TunedKey`) of each grouped matmul of `case`'s layer on `generation`."""
    dtype = jnp.dtype(DTYPE).name
    return [(projection, built.gmm.tiles.TunedKey(generation, case.picks, k, n, case.setting.local_experts, dtype,
                                                  dtype, stored_order(case.model, projection)[1]))
            for projection, k, n in projections(case)]


def standalone_winners(built, cache: Cache, case: Case, generation: str) -> list[dict]:
    """Per projection, the best tiles on `generation` if they beat the heuristic by MIN_GAIN standalone."""
    entries = []
    for projection, key in projection_keys(built, case, generation):
        priced = []
        for tiles in candidates(built, key, generation):
            modelled = standalone(_replay(built, cache, case, key, tiles), generation)
            if modelled.fits_vmem:
                priced.append((modelled.pipelined_time_s, tiles))
        heuristic_s, heuristic = priced[0]
        best_s, best = min(priced, key=lambda item: item[0])
        if best != heuristic and best_s <= (1 - MIN_GAIN) * heuristic_s:
            entries.append({"key": key._asdict(), "tiles": best._asdict(), "label": f"{case.label} {projection}",
                            "standalone_us": round(best_s * 1e6, 2),
                            "standalone_heuristic_us": round(heuristic_s * 1e6, 2),
                            "heuristic_tiles": heuristic._asdict()})
    return entries


@contextlib.contextmanager
def tuned_as(built, entries: list[dict]):
    """The built kernel's TUNED_TILES as exactly `entries` while in the block (gmm.tiles.select reads it per call)."""
    table = built.gmm.tiles.TUNED_TILES
    kept = dict(table)
    table.clear()
    table.update(tuned_tiles(entries, built.gmm.tiles.TunedKey, built.gmm.tiles.TileConfig))
    try:
        yield
    finally:
        table.clear()
        table.update(kept)


def layer_us(built, cache: Cache, compiler: Compiler, case: Case, generation: str, entries: list[dict]) -> float:
    """The layer's calibrated pipelined figure on `generation` with only `entries` tuned (inf if it fails)."""
    layer = ours_layer(built, case.model, generation)
    with tuned_as(built, entries):
        program = compiler.submit(layer, case.avals(concrete_index=False), generation,
                                  kind="ours' layers in the tile search").result()
        replayed = replay(cache, layer, case.avals(concrete_index=True))
    if isinstance(program, dict):
        return float("inf")
    figures = timings(program, replayed, case, generation)
    return figures.get("headline_us", float("inf"))


def kept_in_layer(built, cache: Cache, compiler: Compiler, case: Case, generation: str,
                  entries: list[dict]) -> list[dict]:
    """Of one case's standalone winners on `generation`, the subset that makes the layer fastest (none when none
    beats the heuristic there); each kept entry records both layer figures."""
    if not entries:
        return []
    heuristic_us = layer_us(built, cache, compiler, case, generation, [])
    subsets = [list(s) for size in range(len(entries), 0, -1) for s in itertools.combinations(entries, size)]
    best_us, best = min(((layer_us(built, cache, compiler, case, generation, s), s) for s in subsets),
                        key=lambda item: item[0])
    if best_us >= heuristic_us:
        return []
    return [{**entry, "layer_us": round(best_us, 2), "layer_heuristic_us": round(heuristic_us, 2)} for entry in best]


def write_table(repo: Path, entries: list[dict], searched_keys: list[dict]) -> Path:
    """The table with `entries` in place of whatever it held for the keys searched (`searched_keys`, as dicts);
    the entries of shapes not searched this run stay."""
    path = repo / TABLE
    searched = [dict(key) for key in searched_keys]
    kept = [entry for entry in json.loads(path.read_text())["entries"] if entry["key"] not in searched]
    entries = sorted(kept + entries, key=lambda e: tuple(str(e["key"][field]) for field in TUNED_KEY_ORDER))
    path.write_text(json.dumps({
        "what": "Grouped-matmul tiles of ragged-dot's experts layer at the prefill shapes of tpu-kernels' moe_layer "
                "benchmark, searched on its calibrated model (`python -m benchmarks moe_layer --tune-ours`); each beats "
                f"the heuristic's by at least {MIN_GAIN:.0%} there and makes the layer faster. Modelled, not "
                "measured on a TPU.",
        "entries": entries,
    }, indent=1, sort_keys=True) + "\n")
    return path
