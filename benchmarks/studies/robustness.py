"""Which published claims survive the constants no chip of that kind has told us: `python -m benchmarks robustness`.

Three of the model's constants are not identified by a timing of their kind:

- the share of the peak HBM bandwidth the copies reach (hbm_fractions.json: v6e's 0.9 from its own weight-streaming
  timings, `v6e_tokamax_data`; 1.0 on v5e, a clamp, and borrowed from it elsewhere), plausibly from 0.78 (TPU7x's
  weight-streaming calls) to 1.0;
- v6e's cost per grid step (model_constants.json: the 0.0217 us at which Hugging Face's measured 257 us layer is
  priced as measured, one timing), from 0.02 us to 0.34 us (v5e's value, which v6e borrowed until its own data were
  priced); HF's 56.6 ms step bounds it from above at 0.157 us (decode_step.json's `hf_kernel_check`), both quoted in
  the JSON's `v6e_grid_step_data`;
- a fixed cost per copy a kernel issues itself (none is priced: `perf.kernel_dmas`), from 0 to half the
  generation's fitted grid-step cost (v6e: half of v5e's, the top of v6e's priced step range: one timing's fit
  does not bound a copy's issue): a pipelined grid step issues at least two copies (a block in, a block out),
  and its fitted fixed cost covers issuing them, so one issue costs no more than half of it. Our paged kernel
  issues one copy per page of K and of V; its issues overlap the copies in flight (its copies term becomes the
  longer of the transfers and the issues); vLLM's fused MoE kernel's copy descriptors add to its time.

v6e's step and share were borrowed from v5e (0.34 us, 1.0) until v6e's own data priced them: each v6e claim is
also priced at those borrowed constants (`at_borrowed`), so a claim that flipped with the new prices is named.

For every claim the results publish (ours against the best rival per shape and generation in moe_layer.json,
moe_layer_v5p_tpu7x.json and moe_layer_v5p.json (v5p's grid-step cost, borrowed from v5e too, is held: no v5p timing bounds it), the
anchor (ours at least 95 % of the floor at the priced HBM share: its bytes at the peak over the share), >= 85 % of the HBM roofline for paged decode, the whole-step ratio of decode_step.json, and
moe_backward.json's backward kernels against megablox's and tokamax's and its backward / forward ratio target) this
re-prices the claim's figures over each constant's range, one at a time and over the ranges jointly,
and calls the claim robust (it holds everywhere) or fragile (it flips: at which value of which constant).

The re-pricing works on the terms each study recorded, from the constants the study priced them at (its JSON's
`priced_at`; results written before studies recorded them were priced at the constants v6e borrowed, and are read so),
to each point, whose absent constants take the fitted values: a claim's figure "at the fitted constants" is the
model's now, before its study is run again. It follows how the model prices the terms: the grid-step cost
is a fixed cost per (core) step, so a time moves by its recorded step cost times the step cost's ratio; a copy's
issue cost adds per copy; the HBM share enters through the recorded price at 0.85 (moe_layer's `hbm85_us`,
moe_backward's `pipelined_hbm85_us`,
linear in 1/share through it and the fitted price), through the copies term (paged attention: the whole copies term
and XLA's relayout scale with 1/share, an upper bound on the pipelined time), or (the decode step's XLA programs,
priced by their bytes) the whole term scales with 1/share. Each time is affine in the step cost and 1/share (and,
but for the paged kernel's overlap, in the copy cost), so a ratio of two is monotone in each constant and its
extremes lie at the ranges' corners; a best rival that changes inside the ranges is why the joint worst point is
sought on a grid that includes the corners. A claim flips at the value found by bisection between where it holds
and where it does not. The rivals keep the tiling their search chose at the fitted constants (a cheaper step could
make a smaller tiling faster still).

Output: benchmarks/results/robustness.json (`--out`); `python -m benchmarks report` renders robustness.md from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.perf import chip
from benchmarks.studies import result_path, write_json
from benchmarks.studies.moe_layer.rivals import RIVALS
from benchmarks.studies.moe_layer.shapes import ANCHOR, ANCHOR_DISPATCH
from benchmarks.studies.moe_layer.targets import ANCHOR_MIN_PCT_OF_FLOOR, anchor_pct
from benchmarks.studies.moe_layer.vllm_fused import FUSED

DEFAULT_OUT = result_path("robustness.json")
HBM_SHARE, GRID_STEP, COPY_COST = "hbm_share", "v6e_grid_step_us", "copy_issue_us"
SHARE_RANGE = (0.78, 1.0)
V6E_STEP_RANGE_US = (0.02, 0.34)
# v6e's constants before its own data priced them (v5e's): each v6e claim is priced there too (`at_borrowed`).
V6E_BORROWED = {HBM_SHARE: 1.0, GRID_STEP: 0.34}
# The share moe_layer prices every variant at beside the fitted one (`hbm85_us`).
MOE_SECOND_SHARE = 0.85
MOE_RIVALS = (*RIVALS, FUSED)
ANCHOR_LABELS = tuple(f"{setting} T={tokens}" for setting, tokens, _ in (ANCHOR, ANCHOR_DISPATCH))
KV_ITEMSIZE = 2  # bf16 caches
# Values per constant of the joint grid the worst point is sought on (its ends are the ranges' corners).
JOINT_GRID = 5


def copy_cost_bound_us(generation: str) -> float:
    """Half the generation's fitted grid-step cost (v6e: v5e's, the top of its priced step range): module
    docstring."""
    fitted_from = "v5e" if generation in ("v5e", "v6e", "v5p") else generation
    return chip.grid_step_s(fitted_from) * 1e6 / 2


@dataclasses.dataclass(frozen=True)
class Claim:
    """One published claim: `value(point)` re-prices its figure at a point (constant name -> value; absent:
    fitted); it holds while the figure is at most (`at_most`) or at least the threshold."""

    family: str
    claim: str
    generation: str
    threshold: float
    at_most: bool
    ranges: dict[str, tuple[float, float, float]]  # constant -> (fitted, low, high)
    value: Callable[[dict], float]

    def holds(self, figure: float) -> bool:
        return figure <= self.threshold if self.at_most else figure >= self.threshold


def flip_point(claim: Claim, name: str, holding: float, failing: float, rounds: int = 40) -> float:
    """The value of constant `name` where the claim stops holding, between a value where it holds and one where it
    does not (the figure is monotone in each constant: module docstring)."""
    for _ in range(rounds):
        middle = (holding + failing) / 2
        if claim.holds(claim.value({name: middle})):
            holding = middle
        else:
            failing = middle
    return failing


def evaluate(claim: Claim) -> dict:
    """The claim at the fitted constants, at each end of each range, and at the worst point of the ranges jointly
    (`JOINT_GRID` values of each, ends included); its verdict; a v6e claim also at `V6E_BORROWED`, the constants v6e
    was priced at before its own data."""
    fitted = claim.value({})
    by_constant, flips = {}, []
    for name, (centre, low, high) in claim.ranges.items():
        ends = {"low": claim.value({name: low}), "high": claim.value({name: high})}
        entry = {"fitted": round(centre, 4), "range": [low, high], "at_low": round(ends["low"], 4),
                 "at_high": round(ends["high"], 4),
                 "holds": all(claim.holds(v) for v in ends.values()), "flips_at": None}
        if claim.holds(fitted) and not entry["holds"]:
            end = low if not claim.holds(ends["low"]) else high
            entry["flips_at"] = round(flip_point(claim, name, centre, end), 4)
            flips.append(f"{name} {entry['flips_at']:g}")
        by_constant[name] = entry
    axes = [np.linspace(low, high, JOINT_GRID).tolist() for _, low, high in claim.ranges.values()]
    grid = [dict(zip(claim.ranges, values)) for values in itertools.product(*axes)]
    worst_point = max(grid, key=lambda p: claim.value(p) * (1 if claim.at_most else -1), default={})
    worst = claim.value(worst_point)
    robust = claim.holds(fitted) and all(e["holds"] for e in by_constant.values()) and claim.holds(worst)
    if claim.holds(fitted) and not flips and not claim.holds(worst):
        flips.append("only jointly: " + ", ".join(f"{k} {v:g}" for k, v in worst_point.items()))
    found = {"family": claim.family, "claim": claim.claim, "generation": claim.generation,
             "threshold": claim.threshold, "holds_if": "at_most" if claim.at_most else "at_least",
             "fitted": round(fitted, 4), "holds_at_fitted": claim.holds(fitted), "by_constant": by_constant,
             "worst_point": {"constants": {k: round(v, 4) for k, v in worst_point.items()}, "value": round(worst, 4),
                             "holds": claim.holds(worst)},
             "verdict": "robust" if robust else "fragile", "flips": flips}
    if claim.generation == "v6e":
        point = {name: value for name, value in V6E_BORROWED.items() if name in claim.ranges}
        value = claim.value(point)
        found["at_borrowed"] = {"constants": point, "value": round(value, 4), "holds": claim.holds(value)}
    return found


def share_range(generation: str) -> tuple[float, float, float]:
    return (chip.FITTED_RATES.hbm_fraction(generation), *SHARE_RANGE)


def step_range(generation: str) -> dict:
    """v6e's borrowed grid-step cost as a range; other generations' are fitted (v5e, TPU7x) or out of scope."""
    return {GRID_STEP: (chip.grid_step_s("v6e") * 1e6, *V6E_STEP_RANGE_US)} if generation == "v6e" else {}


@dataclasses.dataclass(frozen=True)
class Priced:
    """The constants a study's figures were priced at (its JSON's `priced_at`, written by `chip.priced_at`): the
    figures are re-priced from them to a point, whose absent constants take the model's fitted values."""

    hbm_fraction: dict
    grid_step_us: dict

    @classmethod
    def of(cls, study: dict) -> "Priced":
        return cls(**chip.priced_at_of(study))

    def inverse_shares(self, generation: str, point: dict) -> tuple[float, float]:
        """1 / the share the figures were priced at, 1 / the share at `point`."""
        now = point.get(HBM_SHARE, chip.FITTED_RATES.hbm_fraction(generation))
        return 1 / self.hbm_fraction[generation], 1 / now

    def share_scale(self, generation: str, point: dict) -> float:
        """What a time priced by its bytes is multiplied by at `point`."""
        then, now = self.inverse_shares(generation, point)
        return now / then

    def step_scale(self, generation: str, point: dict) -> float:
        """What a time of grid steps is multiplied by at `point` (only v6e's step is swept; the others as fitted)."""
        now = point.get(GRID_STEP) if generation == "v6e" and GRID_STEP in point else chip.grid_step_s(generation) * 1e6
        return now / self.grid_step_us[generation]


def moe_variant_us(line: dict, generation: str, point: dict, priced: Priced) -> float:
    """A figure re-priced at `point` from its recorded terms (module docstring), named as moe_layer's variant lines
    name them: `us` at the share it was priced at, `hbm85_us`, `step_cost_us` and, if it issues copies,
    `dma_descriptors`."""
    then, now = priced.inverse_shares(generation, point)
    per_inverse = (line["hbm85_us"] - line["us"]) / (1 / MOE_SECOND_SHARE - then)
    us = line["us"] + per_inverse * (now - then) + line["step_cost_us"] * (priced.step_scale(generation, point) - 1)
    return us + point.get(COPY_COST, 0.0) * line.get("dma_descriptors", 0)


def moe_claims(moe: dict) -> list[Claim]:
    """Per shape and generation: ours at most the best rival (or, where a rival wins, at least it); the anchor."""
    variants = {}
    for line in moe["variants"]:
        if "us" in line:
            variants.setdefault((line["label"], line["generation"]), {})[line["variant"]] = line
    claims, priced = [], Priced.of(moe)
    for shape in moe["shapes"]:
        if shape.get("best_rival") is None:
            continue
        generation, found = shape["generation"], variants[(shape["label"], shape["generation"])]
        rivals = {name: found[name] for name in MOE_RIVALS if name in found}
        ranges = {HBM_SHARE: share_range(generation), **step_range(generation)}
        if any("dma_descriptors" in r for r in rivals.values()):
            ranges[COPY_COST] = (0.0, 0.0, copy_cost_bound_us(generation))

        def ours_over_best(point, ours=found["ours"], rivals=tuple(rivals.values()), generation=generation):
            return (moe_variant_us(ours, generation, point, priced)
                    / min(moe_variant_us(r, generation, point, priced) for r in rivals))

        best = min(rivals, key=lambda name: moe_variant_us(rivals[name], generation, {}, priced))
        wins = ours_over_best({}) <= 1.0
        claims.append(Claim("moe_layer ranking", f"{shape['label']}: " + (
            "ours at most the best tuned rival" if wins else f"{best} beats ours"),
            generation, 1.0, wins, ranges, ours_over_best))
        if generation == "v6e" and shape["label"] in ANCHOR_LABELS:
            claims.append(Claim(
                "anchor", f"{shape['label']}: ours at least {ANCHOR_MIN_PCT_OF_FLOOR:g} % of the floor at the priced "
                "HBM share", generation, ANCHOR_MIN_PCT_OF_FLOOR, False,
                {HBM_SHARE: share_range(generation), **step_range(generation)},
                lambda point, ours=found["ours"], g=generation, floor=shape["roofline_us"]: anchor_pct(
                    floor, point.get(HBM_SHARE, chip.FITTED_RATES.hbm_fraction(g)),
                    moe_variant_us(ours, g, point, priced))))
    return claims


BACKWARD_KINDS = ("d_lhs", "d_rhs")
BACKWARD_RIVALS = ("megablox", "tokamax")


def backward_line(figures: dict) -> dict:
    """A moe_backward kernel's figures under moe_layer's names (it issues no copies of its own)."""
    return {"us": figures["modelled_time_us"], "hbm85_us": figures["pipelined_hbm85_us"],
            "step_cost_us": figures["step_cost_us"]}


def backward_ranges(generation: str) -> dict:
    return {HBM_SHARE: share_range(generation), **step_range(generation)}


def backward_ranking_claims(backward: dict) -> list[Claim]:
    """Per projection, backward kernel and generation: ours at most the better of megablox and tokamax (or, where
    one is faster, at least it)."""
    claims, priced = [], Priced.of(backward)
    for entry in backward["entries"]:
        for kind in BACKWARD_KINDS:
            kernels = entry["kernels"][kind]
            for generation in sorted(kernels["ours"]):
                ours = backward_line(kernels["ours"][generation])
                rivals = {name: backward_line(kernels[name][generation]) for name in BACKWARD_RIVALS}
                best = min(rivals, key=lambda name: moe_variant_us(rivals[name], generation, {}, priced))

                def ours_over_best(point, ours=ours, rivals=tuple(rivals.values()), generation=generation):
                    return (moe_variant_us(ours, generation, point, priced)
                            / min(moe_variant_us(r, generation, point, priced) for r in rivals))

                wins = ours_over_best({}) <= 1.0

                where = f"{entry['setting']} {entry['projection']} {kind}"
                claims.append(Claim("moe_backward ranking", f"{where}: " + (
                    "ours at most the better of megablox and tokamax" if wins else f"{best} beats ours"),
                    generation, 1.0, wins, backward_ranges(generation), ours_over_best))
    return claims


def backward_ratio_claims(backward: dict) -> list[Claim]:
    """Per layer and generation where moe_backward meets its target: our backward kernels over our forward ones at
    most the target."""
    target = backward["targets"]["backward_forward_ratio_target"]
    claims, priced = [], Priced.of(backward)
    for row in backward["layer_ratios"]:
        generation = row["generation"]
        parts = [e["kernels"] for e in backward["entries"] if e["setting"] == row["setting"]]

        def ratio(point, parts=parts, generation=generation):
            def total(kinds):
                return sum(moe_variant_us(backward_line(p[kind]["ours"][generation]), generation, point, priced)
                           for p in parts for kind in kinds)

            return total(BACKWARD_KINDS) / total(("forward",))

        if ratio({}) > target:
            continue
        claims.append(Claim("backward/forward ratio", f"{row['setting']}: our backward over our forward at most "
                            f"{target:g}", generation, target, True, backward_ranges(generation), ratio))
    return claims


def paged_copies(row: dict, figures: dict) -> float:
    """The copies our paged kernel issues for a row on one generation: as its replay counted them (`dma_copies`),
    else one per page of K and one of V (all KV heads), the minimum bytes over a page's K (or V) bytes."""
    if "dma_copies" in figures:
        return figures["dma_copies"]
    return row["min_bytes"] / (row["page_size"] * row["kv_heads"] * row["head_dim"] * KV_ITEMSIZE)


def paged_pct(figures: dict, copies: float, generation: str, point: dict, priced: Priced) -> float:
    """Our paged kernel's share of the HBM roofline at the share it streams at, re-priced at `point`."""
    share = point.get(HBM_SHARE, chip.FITTED_RATES.hbm_fraction(generation))
    scale = priced.share_scale(generation, point)
    copies_us = figures["hbm_term_us"] * scale
    # Issued from the scalar core while earlier copies stream, the issues overlap the transfers: the copies term
    # becomes the longer of the two.
    time_us = (figures["kernel_time_us"] + copies_us - figures["hbm_term_us"] + (figures["relayout_us"] or 0.0)
               * scale + max(0.0, point.get(COPY_COST, 0.0) * copies - copies_us))
    time_us += figures["step_overhead_us"] * (priced.step_scale(generation, point) - 1)
    return 100.0 * figures["hbm_roofline_us"] / share / time_us


def paged_claims(paged: dict) -> list[Claim]:
    """Per decode row the target covers (mixed lengths, or a context from the target's) and generation where it
    meets the target at the fitted constants: ours at least the target's share of the HBM roofline."""
    target, from_context = paged["targets"]["decode_pct_of_hbm_roofline"], paged["targets"]["from_context"]
    claims, priced = [], Priced.of(paged)
    for row in paged["results"]:
        if row["kind"] != "decode" or (row["context"] is not None and row["context"] < from_context):
            continue
        for generation, figures in row["ours"].items():
            def pct(point, f=figures, c=paged_copies(row, figures), g=generation):
                return paged_pct(f, c, g, point, priced)

            if pct({}) < target:
                continue
            ranges = {HBM_SHARE: share_range(generation), **step_range(generation),
                      COPY_COST: (0.0, 0.0, copy_cost_bound_us(generation))}
            where = f"{row['model']} | {row['batch']} | page {row['page_size']}"
            claims.append(Claim("paged decode", f"{where}: ours at least {target:g} % of the HBM roofline",
                                generation, target, False, ranges, pct))
    return claims


MLA_PATHS = ("transformers", "absorbed", "expanded")


def mla_kernel_us(term: dict, generation: str, point: dict, priced: Priced, copies: float = 0.0) -> float:
    """A replayed kernel's figure re-priced at `point` from its terms (as `paged_pct` re-prices ours): its copies
    term by 1/share, its grid steps at the step cost, and `copies` issued copies overlapping their transfers."""
    copies_us = term["hbm_term_us"] * priced.share_scale(generation, point)
    us = term["us"] + copies_us - term["hbm_term_us"] + max(0.0, point.get(COPY_COST, 0.0) * copies - copies_us)
    return us + term["step_overhead_us"] * (priced.step_scale(generation, point) - 1)


def mla_path_us(path: dict, generation: str, point: dict, priced: Priced) -> float:
    """An MLA path re-priced: its kernel (`mla_kernel_us`), its XLA programs (priced by their bytes) by 1/share."""
    scale = priced.share_scale(generation, point)
    return sum(mla_kernel_us(t, generation, point, priced) if "hbm_term_us" in t else t["us"] * scale
               for t in path["terms"])


def mla_vllm_us(found: dict, generation: str, point: dict, priced: Priced, copies: float) -> float:
    """vLLM's MLA path re-priced: its kernel with `copies` issued copies (one per cache page it reads), plus the two
    XLA matmuls ours has, by 1/share."""
    kernel = found["kernel"]
    matmuls = (found["us"] - kernel["us"]) * priced.share_scale(generation, point)
    return mla_kernel_us(kernel, generation, point, priced, copies) + matmuls


def mla_claims(mla: dict) -> list[Claim]:
    """Per MLA call and generation: ours (the form the model prices cheaper) at most transformers' path and at most
    vLLM's MLA kernel at its best (or vLLM beats ours), and the cheaper form stays the cheaper."""
    claims, priced = [], Priced.of(mla)
    for row in mla["results"]:
        generation = row["generation"]
        if not row.get("model_pick"):
            continue
        # The form the model prices cheaper at the fitted constants.
        pick, other = sorted(("absorbed", "expanded"), key=lambda form: mla_path_us(row[form], generation, {}, priced))
        where = f"{row['model']} {row['call']}"
        ranges = {HBM_SHARE: share_range(generation), **step_range(generation)}

        def ours(point, row=row, generation=generation):
            return min(mla_path_us(row[form], generation, point, priced) for form in ("absorbed", "expanded"))

        if row["transformers"]["us"] == row["transformers"]["us"]:
            claims.append(Claim("mla ranking", f"{where}: ours at most transformers' path", generation, 1.0, True,
                                ranges, lambda point, row=row, g=generation, ours=ours:
                                ours(point) / mla_path_us(row["transformers"], g, point, priced)))
        claims.append(Claim("mla form", f"{where}: the {pick} form at most the {other}", generation, 1.0, True,
                            ranges, lambda point, row=row, g=generation, pick=pick, other=other:
                            mla_path_us(row[pick], g, point, priced) / mla_path_us(row[other], g, point, priced)))
        rival = (row.get("vllm_mla") or {}).get("best", {})
        if "us" in rival:
            pages = row["batch"] * -(-row["kv_len"] // row["vllm_mla"]["page_size"])

            def over_vllm(point, rival=rival, g=generation, ours=ours, pages=pages):
                return ours(point) / mla_vllm_us(rival, g, point, priced, pages)

            wins = over_vllm({}) <= 1.0
            claims.append(Claim("mla ranking", f"{where}: " + ("ours at most vLLM's MLA kernel" if wins else
                                                               "vLLM's MLA kernel beats ours"), generation, 1.0, wins,
                                {**ranges, COPY_COST: (0.0, 0.0, copy_cost_bound_us(generation))}, over_vllm))
    return claims


def step_path_ms(path: dict, experts_scale: float, share_scale: float) -> float:
    """A decode-step path's total re-priced: its experts term by `experts_scale`, the formula-priced all-reduce as
    is, every other term (XLA programs priced by their bytes, our kernels) by `share_scale`."""
    total = 0.0
    for term in path["terms"]:
        if term["error_kind"] == "pallas_ragged_dot":
            total += term["ms_per_step"] * experts_scale
        elif term["error_kind"].startswith("formula"):
            total += term["ms_per_step"]
        else:
            total += term["ms_per_step"] * share_scale
    return total


def decode_step_claims(step: dict, moe: dict) -> list[Claim]:
    """Per model: the modelled ratio of the default step over HF's configuration stays within its published band."""
    batch, claims, priced, moe_priced = step["method"]["batch"], [], Priced.of(step), Priced.of(moe)
    ours = {line["label"]: line for line in moe["variants"]
            if line["variant"] == "ours" and line["generation"] == "v6e" and "us" in line}
    for model, found in sorted(step["models"].items()):
        comparison = found["comparison"]
        published = comparison[comparison["hf_path"]]
        experts = ours[f"{model} EP8 router-masking T={batch}"]
        paths = found["paths"]

        def ratio(point, paths=paths, hf_path=comparison["hf_path"], experts=experts):
            share_scale = priced.share_scale("v6e", point)
            experts_scale = moe_variant_us(experts, "v6e", point, moe_priced) / experts["us"]
            return (step_path_ms(paths["transformers_default"], experts_scale, share_scale)
                    / step_path_ms(paths[hf_path], experts_scale, share_scale))

        low, high = published["modelled_ratio_band"]
        ranges = {HBM_SHARE: share_range("v6e"), **step_range("v6e")}
        for at_most, bound in ((False, low), (True, high)):
            side = "at most its band's high end" if at_most else "at least its band's low end"
            claims.append(Claim("decode step", f"{model}: the default step over HF's configuration's {side}",
                                "v6e", bound, at_most, ranges, ratio))
    return claims


def rests_on(step: dict) -> dict:
    """Per model, what the whole-step ratio stands on that no timing checks (decode_step.json's own figures)."""
    found = {}
    for model, entry in sorted(step["models"].items()):
        comparison = entry["comparison"]
        totals = {name: path["total"] for name, path in entry["paths"].items()}
        found[model] = {
            "ratio": comparison[comparison["hf_path"]]["modelled_ratio"],
            "hf_measured_ratio": comparison["hf_measured_ratio"],
            "uncalibrated_share_of_default": round(totals["transformers_default"]["ms_by_error_kind"]
                                                   .get("uncalibrated", 0.0) / totals["transformers_default"]["ms"], 4),
            "uncalibrated_share_of_hf_configuration": round(
                totals[comparison["hf_path"]]["ms_by_error_kind"].get("uncalibrated", 0.0)
                / totals[comparison["hf_path"]]["ms"], 4),
            "batched_mm_share_of_default": comparison["batched_mm_share_of_default"],
            **{key: comparison.get("kernelized_vs_hf", {}).get(key) for key in
               ("hf_implied_default_ms", "modelled_default_device_ms", "hf_measured_ms", "modelled_device_ms")},
        }
    return found


def v6e_grid_step_data(moe: dict, step: dict) -> dict:
    """What v6e's own timings say of its grid-step cost: the step cost that makes HF's 257 us layer (a fit to one
    timing, per EP mode) and the bound HF's measured step sets (decode_step's `hf_kernel_check`)."""
    fits = {shape: entry["step_cost_that_gives_measured_us"] for shape, entry in moe["hf_257us"]["shapes"].items()}
    bound = step["models"]["qwen3-30b-a3b"]["hf_kernel_check"]
    return {"fitted_us": round(chip.grid_step_s("v6e") * 1e6, 4), "borrowed_until_now_us": V6E_BORROWED[GRID_STEP],
            "fit_from_hf_257us_us": fits,
            "bound_from_hf_step_us": bound["grid_step_cost_bound_us"],
            "bound_from_hf_step_with_host_us": bound["grid_step_cost_bound_with_host_us"],
            "range_priced_us": list(V6E_STEP_RANGE_US)}


def v6e_tokamax_data(fit: dict) -> dict:
    """What tokamax's v6e timings (calibration_fit_v6e.json) say of the two constants: the HBM share its weight-
    streaming timings imply, the grid step its Pallas timings fit alone, and across the priced step range the share
    that fits them best with the fit error there (a flat error: the step is not identified)."""
    share = fit["hbm_fraction"].get("v6e", {})
    in_range = [row for row in fit["step_share_profile"]["v6e"]
                if V6E_STEP_RANGE_US[0] <= row["grid_step_us"] <= V6E_STEP_RANGE_US[1]]
    return {"sources": fit["hbm_fraction_sources"],
            "hbm_share": share.get("hbm_fraction") if "borrowed_from" not in share else None,
            "hbm_share_timings": len(share.get("entries", [])),
            "grid_step_fit_alone_us": round(fit["fits"]["v6e"]["constants"]["grid_step_s"] * 1e6, 4),
            "best_share_across_step_range": [min(r["best_hbm_fraction"] for r in in_range),
                                             max(r["best_hbm_fraction"] for r in in_range)],
            "fit_error_across_step_range": [min(r["fit_median_log_error"] for r in in_range),
                                            max(r["fit_median_log_error"] for r in in_range)]}


def study(results: Path) -> dict:
    moe = json.loads((results / "moe_layer.json").read_text())
    other_generations = [json.loads((results / name).read_text())
                         for name in ("moe_layer_v5p_tpu7x.json", "moe_layer_v5p.json")]
    paged = json.loads((results / "paged_attention.json").read_text())
    step = json.loads((results / "decode_step.json").read_text())
    backward = json.loads((results / "moe_backward.json").read_text())
    mla = json.loads((results / "mla.json").read_text())
    tokamax = v6e_tokamax_data(json.loads((results / "calibration_fit_v6e.json").read_text()))
    claims = [evaluate(c) for c in (*moe_claims(moe), *(c for r in other_generations for c in moe_claims(r)),
                                           *paged_claims(paged),
                                           *decode_step_claims(step, moe), *backward_ranking_claims(backward),
                                           *backward_ratio_claims(backward), *mla_claims(mla))]
    return {
        "benchmark": "benchmarks.studies.robustness",
        "what": sys.modules[__name__].__doc__.split("\n\n")[1].replace("\n", " "),
        "constants": {
            HBM_SHARE: {"range": list(SHARE_RANGE), "fitted": dict(chip.FITTED_RATES.hbm_fractions)},
            GRID_STEP: {"range": list(V6E_STEP_RANGE_US), "fitted": round(chip.grid_step_s("v6e") * 1e6, 4)},
            COPY_COST: {"range_high": {g: copy_cost_bound_us(g) for g in ("v5e", "v6e", "v5p", "tpu7x")},
                        "fitted": 0.0},
        },
        "v6e_grid_step_data": v6e_grid_step_data(moe, step),
        "v6e_tokamax_data": tokamax,
        "decode_step_rests_on": rests_on(step),
        "claims": claims,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_OUT.parent, help="the studies' results to read")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    report = study(args.results)
    verdicts = [c["verdict"] for c in report["claims"]]
    print(f"wrote {write_json(args.out, report)}: {verdicts.count('robust')} robust, "
          f"{verdicts.count('fragile')} fragile of {len(verdicts)} claims")
    return 0


if __name__ == "__main__":
    sys.exit(main())
