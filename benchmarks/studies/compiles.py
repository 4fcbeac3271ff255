"""Compiles a kernelized model meets: how many distinct kernel shapes, and the real seconds to compile them.

On a TPU, every new shape a kernel op sees is a Mosaic compile on the host before the call can run. This
counts the distinct shapes of our three kernels (RMSNorm, the experts layer, flash attention) that two
workloads produce, at Qwen3-30B-A3B, GPT-OSS-20B and Gemma 4 26B-A4B shapes, batch 1, bf16, one chip:

- `generate`: a default `generate` of 128 new tokens (the prefill, then 127 decode steps whose key
  length grows by one each) at each of PROMPT_LENGTHS;
- `serving trace`: 200 requests with prompt lengths drawn uniformly from 1 to 4096 (seed TRACE_SEED),
  each run as `generate` runs one (a prefill and 127 decode steps at batch 1). The packed token batches
  of `generate_batch` are not modelled: each request's calls are those a batch-1 server makes;

each `before` (every token count and key length its own shape) and `after` (padded to the buckets of
`tpu_kernels/runtime/buckets.py`, as the kernels' entry points pad them: rows and query lengths to
`token_bucket`, a per-head norm's rows to `token_bucket(tokens)` times its heads, a decode step's one query
staying one, key lengths to `key_bucket`).

Compile seconds are measured, not modelled: each distinct shape is compiled ahead of time for v6e and
TPU7x (libtpu compile-only topologies) on this machine's CPU, where a TPU host would compile it too.
Each distinct shape is compiled once and its seconds reused wherever it recurs. An op with more
distinct shapes than `--sample` has an evenly spaced sample of them compiled (the smallest and the
largest always among them), sorted by size, and the rest priced by linear interpolation between the
measured shapes on either side (compile time grows with the blocks a shape gets): the JSON gives, per op, how many
shapes were measured and how many extrapolated, and every total says how much of it is extrapolated.
`first_call_s` is the compile time the workload's first request waits for in a cold process (its
prefill's shapes and its decode steps'); `total_s` all the workload's compiles, one after another.

The buckets bound the kernel shapes, but the entry points pad to them and slice back with torch ops at the
real shapes, each an XLA program of its own under torch_tpu eager (`bucketing_programs`: with the default
dynamic cache, the key pads of every decode step). `after.bucketing_programs` counts and prices them the same
way (jax-lowered equivalents, sampled and interpolated per group alike), apart from the kernel figures.

`end_to_end` counts every program of a whole `generate` under TorchTPU's strict eager, kernels, our ops and
transformers' own, with a dynamic cache and with the fixed-shape recipe (`compiles_end_to_end.py`).

Usage:
    python -m benchmarks compiles [--out benchmarks/results/compiles.json] [--sample 4] [--quick] [--end-to-end-only]
    (or JAX_PLATFORMS=cpu python -m benchmarks.studies.compiles; paths relative to the current directory)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import kernels

from benchmarks.studies import (
    KERNEL_REPOS_DIR, bucketing_programs, compiles_end_to_end, require_kernel_repo, result_path, write_json,
)
from benchmarks.studies.model_shapes import ATTENTION_HEADS, ATTENTION_SINKS, ATTENTION_WINDOWS, EXPERTS_MODELS
from tpu_kernels.aot import compile_for
from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.runtime.buckets import key_bucket, token_bucket

GENERATIONS = ("v6e", "tpu7x")
PROMPT_LENGTHS = (7, 100, 500, 1000, 3000)
NEW_TOKENS = 128
TRACE_REQUESTS = 200
TRACE_MAX_PROMPT = 4096
TRACE_SEED = 0
BF16 = jnp.bfloat16


@dataclass(frozen=True)
class Attention:
    """One kind of attention layer: KV heads, head_dim, sliding window (None: full), attention sinks."""

    kv_heads: int
    head_dim: int
    window: int | None = None
    sinks: bool = False

    def keys_seen(self, tokens: int, keys: int) -> int:
        """The key length this layer's attention sees in a forward of `tokens` against `keys` keys. transformers'
        default cache keeps a sliding layer's last window - 1 keys (`DynamicSlidingWindowLayer`): its prefill sees
        the whole prompt, each decode step at most the window."""
        if self.window is None or tokens == keys:
            return keys
        return min(keys, self.window - 1 + tokens)


@dataclass(frozen=True)
class Model:
    hidden: int
    q_heads: int
    attention: tuple[Attention, ...]
    qk_norms: bool  # RMSNorm over each head's q and k ([tokens, heads, head_dim], rows: tokens x heads)
    experts: int
    intermediate: int
    top_k: int
    gate: dict
    router_weights: str = "bfloat16"  # the dtype of the routing weights the router hands the experts layer


def _model(experts_tag: str, attention: tuple[tuple[str, bool], ...], qk_norms: bool,
           router_weights: str = "bfloat16") -> Model:
    """A model from the kernels' one list of shapes: its experts layer by tag, its kinds of attention layer as
    (tag, whether the tag's window applies), whether it norms each head's q and k and its routing weights' dtype
    (no kernel table says)."""
    experts = EXPERTS_MODELS[experts_tag]
    gate = experts["gate"]
    kinds = tuple(Attention(ATTENTION_HEADS[tag]["kv_heads"], ATTENTION_HEADS[tag]["head_dim"],
                            window=ATTENTION_WINDOWS.get(tag) if windowed else None, sinks=tag in ATTENTION_SINKS)
                  for tag, windowed in attention)
    return Model(experts["hidden"], ATTENTION_HEADS[attention[0][0]]["q_heads"], kinds, qk_norms, experts["experts"],
                 experts["intermediate"], experts["top_k"],
                 dict(activation=gate["activation"], weights_transposed=experts["weights_transposed"],
                      **{name: value for name, value in gate.items() if name != "activation"}), router_weights)


MODELS = {
    "Qwen3-30B-A3B": _model("qwen3-30b-a3b", (("qwen3-30b-a3b", True),), qk_norms=True),
    # GPT-OSS alternates sliding-window and full layers, both with sinks.
    "GPT-OSS-20B": _model("gpt-oss-20b", (("gpt-oss-20b", True), ("gpt-oss-20b", False)), qk_norms=False),
    # Gemma 4's router scales its float32 top-k probabilities by a per-expert scale: float32 routing weights.
    "Gemma 4 26B-A4B": _model("gemma-4-26b-a4b", (("gemma-4-26b-a4b sliding", True), ("gemma-4-26b-a4b global", True)),
                              qk_norms=True, router_weights="float32"),
}


def calls_of_request(prompt: int, new_tokens: int = NEW_TOKENS) -> list[tuple[int, int]]:
    """(tokens, key length) of each forward a batch-1 `generate` makes: the prefill, then one token at a time."""
    return [(prompt, prompt)] + [(1, prompt + step) for step in range(1, new_tokens)]


def workloads() -> dict[str, list[list[tuple[int, int]]]]:
    """Each workload as its requests, each request as its calls (tokens, key length)."""
    lengths = random.Random(TRACE_SEED).choices(range(1, TRACE_MAX_PROMPT + 1), k=TRACE_REQUESTS)
    return {"generate": [calls_of_request(p) for p in PROMPT_LENGTHS],
            "serving trace": [calls_of_request(p) for p in lengths]}


def op_shapes(model: Model, tokens: int, keys: int, bucketed: bool) -> set[tuple]:
    """The kernel shapes one forward of `tokens` against `keys` keys compiles: (op, shape...) tuples."""
    rows = token_bucket if bucketed else (lambda n: n)
    queries = tokens if tokens == 1 or not bucketed else token_bucket(tokens)
    key_length = key_bucket if bucketed else (lambda n: n)
    shapes = {("rms_norm", rows(tokens), model.hidden), ("experts", rows(tokens))}
    for kind in model.attention:
        shapes.add(("attention", kind, queries, key_length(kind.keys_seen(tokens, keys))))
        if model.qk_norms:
            shapes |= {("rms_norm", rows(tokens) * model.q_heads, kind.head_dim),
                       ("rms_norm", rows(tokens) * kind.kv_heads, kind.head_dim)}
    return shapes


def shapes_of(model: Model, requests: list[list[tuple[int, int]]], bucketed: bool) -> list[set[tuple]]:
    """Per request, the shapes its calls compile."""
    return [set().union(*(op_shapes(model, t, k, bucketed) for t, k in calls)) for calls in requests]


class Kernels:
    """The three kernels' JAX functions from their builds, traced at a shape for one generation."""

    def __init__(self, built: dict):
        self.norm = importlib.import_module(f"{built['rmsnorm'].__name__}.norm.kernel").rms_norm_forward
        self.layer = importlib.import_module(f"{built['experts'].__name__}.layer").experts_layer
        self.flash = importlib.import_module(
            f"{built['attention'].__name__}.flash.kernel").differentiable_flash_attention

    def target(self, model: Model, shape: tuple, generation: str):
        """(fn, avals) of one shape of `op_shapes`, or of one program of `bucketing_programs`."""
        op = shape[0]
        if bucketing_programs.is_program(shape):
            return bucketing_programs.target(shape)
        if op == "rms_norm":
            _, rows, width = shape
            fn = lambda x, w: self.norm(x, w, eps=1e-6, generation=generation)  # noqa: E731
            return fn, [jax.ShapeDtypeStruct((rows, width), BF16), jax.ShapeDtypeStruct((width,), BF16)]
        if op == "experts":
            return self._experts(model, shape[1], generation)
        return self._attention(model, *shape[1:], generation)

    def _experts(self, model: Model, tokens: int, generation: str):
        e, h, i = model.experts, model.hidden, model.intermediate
        transposed = model.gate["weights_transposed"]
        weights = [(e, h, 2 * i), (e, i, h)] if transposed else [(e, 2 * i, h), (e, h, i)]
        if model.gate["activation"] == "clamped_swiglu":
            weights += [(e, 2 * i), (e, h)]
        avals = [jax.ShapeDtypeStruct((tokens, h), BF16), jax.ShapeDtypeStruct((tokens, model.top_k), jnp.int32),
                 jax.ShapeDtypeStruct((tokens, model.top_k), BF16), *(jax.ShapeDtypeStruct(w, BF16) for w in weights)]
        return (lambda *arrays: self.layer(*arrays, generation=generation, **model.gate)), avals

    def _attention(self, model: Model, kind: Attention, queries: int, keys: int, generation: str):
        q = jax.ShapeDtypeStruct((1, model.q_heads, queries, kind.head_dim), BF16)
        kv = jax.ShapeDtypeStruct((1, kind.kv_heads, keys, kind.head_dim), BF16)
        avals = [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32)]
        if kind.sinks:
            avals.append(jax.ShapeDtypeStruct((model.q_heads,), BF16))

        def attend(q, k, v, kv_lengths, *sinks):
            return self.flash(q, k, v, kv_lengths=kv_lengths, sliding_window=kind.window,
                              sinks=sinks[0] if sinks else None, generation=generation)

        return attend, avals


def group_of(shape: tuple) -> str:
    """The shapes whose compile times are alike: one op, one layer kind, prefill or decode."""
    if bucketing_programs.is_program(shape):
        return bucketing_programs.group_of(shape)
    if shape[0] == "rms_norm":
        return f"rms_norm width {shape[2]}"
    if shape[0] == "experts":
        return "experts"
    kind, queries = shape[1], shape[2]
    window = f" window {kind.window}" if kind.window else ""
    step = "decode" if queries == 1 else "prefill"
    return f"attention kv {kind.kv_heads} d {kind.head_dim}{window} {step}"


def sizes(shape: tuple) -> list[int]:
    if bucketing_programs.is_program(shape):
        return bucketing_programs.sizes(shape)
    return [x for x in shape if isinstance(x, int)]


def sample_positions(count: int, sample: int) -> list[int]:
    """At most `sample` evenly spaced positions of `count` sorted shapes, the first and the last always among them."""
    if count <= sample:
        return list(range(count))
    return sorted({round(i * (count - 1) / (sample - 1)) for i in range(sample)})


def measure(kernels_: Kernels, model: Model, shapes: set[tuple], generation: str, sample: int, log) -> dict:
    """{shape: (seconds, measured)} for every shape: a sample compiled per group (sorted by size), the rest priced
    by linear interpolation between the measured shapes on either side, by position in that order."""
    groups: dict[str, list[tuple]] = {}
    for shape in shapes:
        groups.setdefault(group_of(shape), []).append(shape)
    priced = {}
    for name, members in sorted(groups.items()):
        ordered = sorted(members, key=sizes)
        positions = sample_positions(len(ordered), sample)
        for position in positions:
            fn, avals = kernels_.target(model, ordered[position], generation)
            start = time.perf_counter()
            with jax.enable_x64(any(aval.dtype == jnp.int64 for aval in avals)):  # a bucketing program's int64 ids
                compile_for(fn, avals, generation)
            priced[ordered[position]] = (time.perf_counter() - start, True)
            log(f"  {generation} {name} {avals[0].shape}: {priced[ordered[position]][0]:.2f} s")
        for low, high in zip(positions, positions[1:]):
            low_s, high_s = priced[ordered[low]][0], priced[ordered[high]][0]
            for position in range(low + 1, high):
                priced[ordered[position]] = (low_s + (high_s - low_s) * (position - low) / (high - low), False)
    return priced


def summary(requests: list[set[tuple]], priced: dict) -> dict:
    every = set().union(*requests)
    per_op: dict[str, dict] = {}
    for shape in every:
        entry = per_op.setdefault(group_of(shape), {"shapes": 0, "measured": 0, "seconds": 0.0})
        entry["shapes"] += 1
        entry["measured"] += priced[shape][1]
        entry["seconds"] += priced[shape][0]
    return {
        "distinct_shapes": len(every),
        "measured_shapes": sum(priced[s][1] for s in every),
        "total_s": sum(priced[s][0] for s in every),
        "extrapolated_s": sum(priced[s][0] for s in every if not priced[s][1]),
        "first_call_s": sum(priced[s][0] for s in requests[0]),
        "per_op": dict(sorted(per_op.items())),
    }


def study(kernels_: Kernels, models: dict, generations, sample: int, log) -> dict:
    results = {}
    for model_name, model in models.items():
        requests = {(workload, mode): shapes_of(model, calls, mode == "after")
                    for workload, calls in workloads().items() for mode in ("before", "after")}
        # Only the buckets pad and cut: without them the kernels run at the real shapes.
        programs = {workload: bucketing_programs.of_requests(model, calls) for workload, calls in workloads().items()}
        every = set().union(*(set().union(*r) for r in [*requests.values(), *programs.values()]))
        for generation in generations:
            log(f"{model_name} {generation}: {len(every)} distinct kernel shapes and bucketing programs")
            priced = measure(kernels_, model, every, generation, sample, log)
            for (workload, mode), shapes in requests.items():
                entry = summary(shapes, priced)
                if mode == "after":
                    entry["bucketing_programs"] = summary(programs[workload], priced)
                results.setdefault(model_name, {}).setdefault(generation, {}).setdefault(workload, {})[mode] = entry
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=result_path("compiles.json"))
    parser.add_argument("--sample", type=int, default=4, help="shapes compiled per op group (default 4)")
    parser.add_argument("--quick", action="store_true", help="Qwen3-30B-A3B on v6e only, 2 shapes per group")
    parser.add_argument("--kernel-repos", type=Path, default=KERNEL_REPOS_DIR)
    parser.add_argument("--end-to-end-only", action="store_true",
                        help="recount only the end-to-end programs (compiles_end_to_end.py) into the existing --out")
    args = parser.parse_args(argv)
    if args.sample < 2:
        parser.error("--sample must be at least 2 (the smallest and the largest shape of a group)")
    models = {"Qwen3-30B-A3B": MODELS["Qwen3-30B-A3B"]} if args.quick else MODELS
    generations = GENERATIONS[:1] if args.quick else GENERATIONS
    with tempfile.TemporaryDirectory() as build_dir:
        builds = {kind: build_kernel_repo(require_kernel_repo(args.kernel_repos / repo, "--kernel-repos"),
                                          Path(build_dir))
                  for kind, repo in (("rmsnorm", "rmsnorm-tpu"), ("experts", "ragged-dot-tpu"),
                                     ("attention", "attention-tpu"))}
        end_to_end = compiles_end_to_end.study({kind: str(path) for kind, path in builds.items()}, args.quick)
        if args.end_to_end_only:
            print(f"wrote {write_json(args.out, {**json.loads(args.out.read_text()), 'end_to_end': end_to_end})}")
            return 0
        built = {kind: kernels.get_local_kernel(path, backend="cpu") for kind, path in builds.items()}
        results = study(Kernels(built), models, generations, 2 if args.quick else args.sample, print)
    data = {
        "workloads": {"generate": {"prompt_lengths": list(PROMPT_LENGTHS), "new_tokens": NEW_TOKENS},
                      "serving trace": {"requests": TRACE_REQUESTS, "prompt_lengths": f"uniform 1..{TRACE_MAX_PROMPT}",
                                        "seed": TRACE_SEED, "new_tokens": NEW_TOKENS}},
        "batch": 1, "dtype": "bfloat16",
        "method": ("AOT compiles (libtpu compile-only topologies) on this CPU; per op group at most "
                   f"{args.sample} shapes measured (sorted by size, evenly spaced, the smallest and largest among them), the "
                   "rest interpolated between them (extrapolated_s). after.bucketing_programs: the pads and slices "
                   "our entry points run at the real shapes around the kernels (benchmarks/studies/"
                   "bucketing_programs.py), XLA programs under torch_tpu eager; their seconds are those of "
                   "jax-lowered equivalents (jnp.pad, a slice) compiled the same way, an estimate of torch_tpu's "
                   "cost, whose own lowering of these eager ops is not available off a TPU; each priced as a "
                   "program of its own, an upper bound where torch_tpu's eager mode defers and fuses them into the "
                   "program of the ops around them (EagerMode.DEFER_AND_FUSE)"),
        "cpu_count": os.cpu_count(), "load_average_at_start": list(os.getloadavg()),
        "models": results, "end_to_end": end_to_end,
    }
    print(f"wrote {write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
