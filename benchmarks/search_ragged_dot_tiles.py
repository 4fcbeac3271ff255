"""Search ragged_dot_tpu tile configs over the traffic/roofline model and write the kernel's tile table.

For every grouped matmul (gate_up and down) of the experts-layer benchmark's
settings (`benchmarks/moe_layer.py`: the rows, sentinel rows included, and
group sizes the kernel sees on the rank) at every power-of-two token count
from 1 to 8192, with routing drawn from a different seed than the
benchmark's, and for each generation (v5e, v6e):

1. Candidates are built from five knobs: tile_m ("m" = one resident row tile,
   or 64..2048 rows), tile_k (K, or K/2 for K > 2048), tile_n (N, or N/2,
   N/3, N/4 rounded up to 256), chunk_m (none, 32..256 rows) and
   groups_per_step (1..4, one row tile only). Each is made concrete for the
   sample's M by `config.resolve` and dropped if `config.check_config`
   refuses it (VMEM budget, block alignment, unroll bound).
2. Coordinate descent from three starting points (the heuristic fallback, a
   resident tile with two groups per step, a 512-row tiled config): one knob
   at a time takes its best value, until a round changes nothing. A config
   is scored by the step-by-step double-buffered pipeline time of
   `tpu_kernels.perf` (`pipelined_time_s`), then the aggregate roofline time,
   then VMEM. One grid replay serves both generations.
3. The best config is compiled ahead of time for its generation
   (`tpu_kernels.aot.compile_for`, libtpu compile-only topology); if Mosaic
   refuses it, the next best is tried.

The table lists one entry per (generation, K, N, groups, M); `select_config`
takes the entry of the same K and N whose (M, groups) is nearest in log
space.

Usage:
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/search_ragged_dot_tiles.py [--out PATH] [--settings ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import pprint
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # noqa: E402

from tpu_kernels import perf  # noqa: E402
from tpu_kernels.aot import compile_for  # noqa: E402
from tpu_kernels.hardware import round_up  # noqa: E402

ROOT = moe_layer.ROOT
DEFAULT_OUT = ROOT / "kernel_repos" / "ragged-dot-tpu" / "torch-ext" / "ragged_dot_tpu" / "tile_table.py"
SEARCH_SEED = 1
SEARCH_TOKENS = tuple(2**i for i in range(14))  # 1 .. 8192
ROW_TILES = (64, 128, 256, 512, 1024, 2048)
CHUNKS = (None, 32, 64, 128, 256)
GROUPS_PER_STEP = (1, 2, 3, 4)
MAX_ROUNDS = 4
MAX_COMPILE_ATTEMPTS = 6
KNOBS = ("tile_m", "tile_n", "tile_k", "chunk_m", "groups_per_step")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One grouped matmul of an experts layer as the kernel sees it on one rank."""

    setting: str
    tokens: int
    projection: str
    m: int
    k: int
    n: int
    group_sizes: tuple[int, ...]
    transpose_rhs: bool

    @property
    def groups(self) -> int:
        return len(self.group_sizes)

    @property
    def label(self) -> str:
        return f"{self.setting} T={self.tokens} {self.projection}"

    def sizes_array(self) -> np.ndarray:
        return np.asarray(self.group_sizes, np.int32)

    def avals(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        rhs = (self.groups, self.n, self.k) if self.transpose_rhs else (self.groups, self.k, self.n)
        return jax.ShapeDtypeStruct((self.m, self.k), DTYPE), jax.ShapeDtypeStruct(rhs, DTYPE)

    @property
    def min_bytes(self) -> int:
        active = sum(1 for size in self.group_sizes if size)
        return (active * self.k * self.n + self.m * self.k + self.m * self.n) * jnp.dtype(DTYPE).itemsize

    @property
    def useful_flops(self) -> int:
        return 2 * sum(self.group_sizes) * self.k * self.n


DTYPE = moe_layer.DTYPE
GENERATIONS = moe_layer.GENERATIONS


def make_shapes(settings, tokens_list, seed: int) -> list[Shape]:
    shapes = []
    for setting in settings:
        for tokens in tokens_list:
            case = moe_layer.make_case(setting, tokens, seed)
            sizes = tuple(int(size) for size in case.group_sizes)
            for projection, k, n in moe_layer.projections(case):
                shapes.append(Shape(setting.label, tokens, projection, case.picks, k, n, sizes,
                                    not case.model.weights_transposed))
    return shapes


def model_kernel(fn, shape: Shape) -> dict:
    """The kernel's modelled times per generation (perf's grid replay)."""
    lhs, rhs = shape.avals()
    calls = perf.model_pallas_traffic(fn, lhs, rhs, shape.sizes_array())
    results = {}
    for generation in GENERATIONS:
        modelled = perf.roofline(calls, generation, min_bytes=shape.min_bytes, min_flops=shape.useful_flops)
        results[generation] = {
            "modelled_time_us": modelled.time_s * 1e6,
            "modelled_pipelined_time_us": modelled.pipelined_time_s * 1e6,
            "roofline_us": modelled.roofline_s * 1e6,
            "vmem_bytes": modelled.vmem_bytes,
        }
    return results


def compile_kernel(fn, shape: Shape, generation: str) -> dict:
    lhs, rhs = shape.avals()
    started = time.perf_counter()
    try:
        compile_for(fn, [lhs, rhs, jax.ShapeDtypeStruct((shape.groups,), jnp.int32)], generation)
    except Exception as error:  # noqa: BLE001 - a config Mosaic refuses is a result
        lines = str(error).strip().splitlines()
        return {"compiled": False, "seconds": time.perf_counter() - started, "error": lines[0] if lines else repr(error)}
    return {"compiled": True, "seconds": time.perf_counter() - started}


def knob_values(shape: Shape) -> dict[str, list]:
    k, n, m = shape.k, shape.n, shape.m
    tile_n = [n] + sorted({round_up(math.ceil(n / d), 256) for d in (2, 3, 4)} - {n}, reverse=True)
    return {
        "tile_m": ["m"] + [rows for rows in ROW_TILES if rows < m],
        "tile_k": [k] + ([round_up(math.ceil(k / 2), 256)] if k > 2048 else []),
        "tile_n": [value for value in tile_n if value <= n],
        "chunk_m": list(CHUNKS),
        "groups_per_step": list(GROUPS_PER_STEP),
    }


class Evaluator:
    """Scores table entries for one shape; caches one grid replay per concrete config."""

    def __init__(self, built, shape: Shape):
        self.built = built
        self.shape = shape
        self.replays: dict[tuple, dict | None] = {}
        self.evaluations = 0

    def concrete(self, entry: dict):
        shape = self.shape
        config = self.built.config.resolve(entry, shape.m, shape.k, shape.n, DTYPE)
        try:
            self.built.config.check_config(config, shape.m, shape.k, shape.n, DTYPE)
        except ValueError:
            return None
        return config

    def modelled(self, entry: dict) -> dict | None:
        config = self.concrete(entry)
        if config is None:
            return None
        if config not in self.replays:
            fn = functools.partial(self.built.pallas_tpu.ragged_dot, transpose_rhs=self.shape.transpose_rhs, config=config)
            self.replays[config] = model_kernel(fn, self.shape)
            self.evaluations += 1
        return self.replays[config]

    def score(self, entry: dict, generation: str) -> tuple | None:
        modelled = self.modelled(entry)
        if modelled is None:
            return None
        result = modelled[generation]
        return (
            round(result["modelled_pipelined_time_us"], 4),
            round(result["modelled_time_us"], 4),
            result["vmem_bytes"],
        )


def entry_of(config, m: int) -> dict:
    return {
        "tile_m": "m" if config.tile_m >= m else config.tile_m,
        "tile_k": config.tile_k,
        "tile_n": config.tile_n,
        "chunk_m": config.chunk_m,
        "groups_per_step": config.groups_per_step,
    }


def descend(evaluator: Evaluator, start: dict, values: dict, generation: str) -> dict | None:
    """Coordinate descent over the knobs from `start`; returns the best valid entry found."""
    if evaluator.score(start, generation) is None:
        return None
    best = dict(start)
    for _ in range(MAX_ROUNDS):
        changed = False
        for knob in KNOBS:
            scored = []
            for value in values[knob]:
                candidate = {**best, knob: value}
                score = evaluator.score(candidate, generation)
                if score is not None:
                    scored.append((score, candidate))
            if not scored:
                continue
            score, candidate = min(scored, key=lambda pair: pair[0])
            if score < evaluator.score(best, generation):
                best, changed = candidate, True
        if not changed:
            break
    return best


def search_shape(built, shape: Shape, generation: str, evaluator: Evaluator) -> dict:
    values = knob_values(shape)
    heuristic = built.config.heuristic_config(shape.m, shape.k, shape.n, DTYPE, generation, shape.groups)
    starts = [
        entry_of(heuristic, shape.m),
        {"tile_m": "m", "tile_k": shape.k, "tile_n": shape.n, "chunk_m": 64, "groups_per_step": 2},
        {"tile_m": 512, "tile_k": shape.k, "tile_n": shape.n, "chunk_m": 128, "groups_per_step": 1},
    ]
    finals = [entry for entry in (descend(evaluator, start, values, generation) for start in starts) if entry]
    # Every config the descent scored, best first: the compile check walks down this list.
    ranked = sorted(
        {config: evaluator.score(entry_of(config, shape.m), generation) for config in evaluator.replays
         if evaluator.replays[config] is not None}.items(),
        key=lambda pair: pair[1],
    )
    best_final = min(finals, key=lambda entry: evaluator.score(entry, generation))
    best_config = evaluator.concrete(best_final)
    order = [best_config] + [config for config, _ in ranked if config != best_config]
    attempts = []
    for config in order[:MAX_COMPILE_ATTEMPTS]:
        fn = functools.partial(built.pallas_tpu.ragged_dot, transpose_rhs=shape.transpose_rhs, config=config)
        compiled = compile_kernel(fn, shape, generation)
        attempts.append({"config": tuple(config), **compiled})
        if compiled["compiled"]:
            break
    else:
        raise RuntimeError(f"{shape.label} {generation}: no config compiled: {attempts}")
    chosen = evaluator.replays[config][generation]
    heuristic_result = evaluator.modelled(entry_of(heuristic, shape.m))[generation]
    return {
        "setting": shape.setting,
        "projection": shape.projection,
        "tokens": shape.tokens,
        "k": shape.k,
        "n": shape.n,
        "groups": shape.groups,
        "m": shape.m,
        "dtype": jnp.dtype(DTYPE).name,
        **entry_of(config, shape.m),
        "modelled_pipelined_us": round(chosen["modelled_pipelined_time_us"], 2),
        "modelled_us": round(chosen["modelled_time_us"], 2),
        "roofline_us": round(chosen["roofline_us"], 2),
        "heuristic_pipelined_us": round(heuristic_result["modelled_pipelined_time_us"], 2),
        "compile_attempts": len(attempts),
    }


def write_table(table: dict[str, list[dict]], path: Path, seconds: float) -> None:
    header = f'''"""Searched tile configs of ragged_dot per TPU generation.

Generated by benchmarks/search_ragged_dot_tiles.py (do not edit by hand): a
coordinate-descent search over the tpu_kernels.perf traffic/roofline model
(objective: modelled double-buffered pipeline time), each chosen config
compiled ahead of time for its generation. One entry per projection (K, N),
groups and rows M of a routed sample (seed {SEARCH_SEED}); `select_config`
takes the entry of the same K, N nearest in (log M, log groups).
Times are modelled microseconds; `heuristic_pipelined_us` is the fallback
heuristic's time on the same sample. Search took {seconds:.0f} s.
"""

'''
    body = "TABLE: dict[str, list[dict]] = " + pprint.pformat(table, width=120, sort_dicts=False) + "\n"
    path.write_text(header + body)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--settings", nargs="*", default=[setting.label for setting in moe_layer.SETTINGS])
    parser.add_argument("--tokens", nargs="*", type=int, default=list(SEARCH_TOKENS))
    args = parser.parse_args(argv)

    started = time.perf_counter()
    settings = [setting for setting in moe_layer.SETTINGS if setting.label in args.settings]
    shapes = make_shapes(settings, args.tokens, seed=SEARCH_SEED)
    table: dict[str, list[dict]] = {generation: [] for generation in GENERATIONS}
    seen: set[tuple] = set()
    with tempfile.TemporaryDirectory() as build_dir:
        built = moe_layer.load_kernel(moe_layer.DEFAULT_REPO, Path(build_dir))
        for shape in shapes:
            key = (shape.k, shape.n, shape.groups, shape.m)
            if key in seen:
                continue
            seen.add(key)
            evaluator = Evaluator(built, shape)
            shape_started = time.perf_counter()
            for generation in GENERATIONS:
                entry = search_shape(built, shape, generation, evaluator)
                table[generation].append(entry)
                print(
                    f"{generation} {shape.label:42s} M={shape.m:6d} -> tile_m={entry['tile_m']!s:>5} "
                    f"k={entry['tile_k']:5d} n={entry['tile_n']:5d} chunk={entry['chunk_m']!s:>4} "
                    f"slots={entry['groups_per_step']}  {entry['modelled_pipelined_us']:9.1f} us "
                    f"(roofline {entry['roofline_us']:9.1f}, heuristic {entry['heuristic_pipelined_us']:9.1f})",
                    flush=True,
                )
            print(f"   {evaluator.evaluations} replays, {time.perf_counter() - shape_started:.0f} s", flush=True)
    for entries in table.values():
        entries.sort(key=lambda e: (e["k"], e["n"], e["groups"], e["m"]))
    write_table(table, args.out, time.perf_counter() - started)
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
