"""Hugging Face's measured 257 us: the layer it ran, modelled with the kernel it ships at that kernel's own pick."""

from __future__ import annotations

import json

from benchmarks import perf
from benchmarks.studies import calibration_bands
from benchmarks.perf import grid_step_s

from .cache import Cache
from .rivals import RIVALS
from .shapes import ANCHOR, ANCHOR_DISPATCH, SETTINGS, make_case, projections
from .targets import modelled
from .tuning import TOKAMAX_DEFAULT, rival_replay


HF_MEASURED_US = 257.0  # one Qwen3-30B-A3B experts layer on an EP8 v6e rank at 256 tokens (kernels-community)
HF_SHAPES = (ANCHOR, ANCHOR_DISPATCH)
# tokamax tiles from its own autotuning space probed at the HF shapes: how far the time moves with the tiles.
HF_PROBE_TILES = ((128, 128, 128), (128, 256, 256), (128, 512, 512), (128, 1024, 768), (256, 2048, 768))


def hf_case(rows: list[dict], cache: Cache) -> dict | None:
    """The layer Hugging Face measured at 257 us, modelled with the kernel it ships (tokamax's) at tokamax's pick
    (None for a run without v6e, the chip HF measured on).

    Per EP mode (the article does not say which; Qwen3's default in transformers is dispatch): the
    `tokamax_default` variant's time and terms, the step cost that would make it 257 us, and the standalone
    grouped matmuls at a few other tiles of tokamax's space.
    """
    if not any(row["generation"] == "v6e" for row in rows):
        return None
    # HF's layer is a decode layer: its copies are the longer term.
    calibrated = calibration_bands.error("pallas_ragged_dot", "v6e", "streaming")
    result = {"measured_us": HF_MEASURED_US, "generation": "v6e",
              "constants": f"v6e's grid step ({grid_step_s('v6e') * 1e6:.2f} us) is borrowed from v5e: v6e's timings "
                           "check v5e's constants but do not fit it, and v6e data bound it below that "
                           "(benchmarks/perf/model_constants.json, grid_step_s_note); v6e's error is v5e's in the "
                           "streaming regime (median "
                           f"{100 * calibrated['median']:.1f} %, p90 {100 * calibrated['p90']:.1f} %, "
                           f"{calibrated['count']} timing(s))",
              "shapes": {}}
    for shape in HF_SHAPES:
        row = next((r for r in rows if (r["setting"], r["tokens"], r["generation"]) == shape), None)
        if row is None or not modelled(row["variants"].get(TOKAMAX_DEFAULT)):
            continue
        variant = row["variants"][TOKAMAX_DEFAULT]
        kernels = variant["kernels"]
        without_steps = variant["headline_us"] - kernels["step_cost_us"]
        setting = next(s for s in SETTINGS if s.label == shape[0])
        case = make_case(setting, shape[1])
        probes = []
        for tiles in HF_PROBE_TILES:
            replays = [rival_replay(cache, RIVALS["tokamax"], case, projection, k, n, tiles)
                       for projection, k, n in projections(case)]
            modelled_alone = perf.roofline([c for r in replays for c in r.pallas_calls], "v6e")
            probes.append({"tiles": list(tiles), "grouped_matmuls_alone_us": round(modelled_alone.pipelined_time_s * 1e6, 1),
                           "grid_steps": modelled_alone.steps})
        result["shapes"][" ".join(map(str, shape))] = {
            "tokamax_pick": variant["tiling"],
            "predicted_us": variant["headline_us"],
            "band_p90_us": variant["band"]["p90_us"],
            "predicted_over_measured": round(variant["headline_us"] / HF_MEASURED_US, 3),
            "grid_steps": kernels["grid_steps"],
            "grid_step_cost_us": kernels["step_cost_us"],
            "without_step_cost_us": round(without_steps, 1),
            "kernels_hbm_us": kernels["hbm_us"],
            "xla_ops_us": variant["xla_ops"]["us"],
            "step_cost_that_gives_measured_us": (round((HF_MEASURED_US - without_steps) / kernels["grid_steps"], 4)
                                                 if kernels["grid_steps"] else None),
            "tokamax_tuned_us": row["variants"].get("tokamax", {}).get("headline_us"),
            "ours_us": row.get("ours_us"),
            "other_tiles": probes,
        }
    result["largest_step_share_in_calibration"] = largest_step_share()
    return result


def largest_step_share() -> dict:
    """Per chip, the measured Pallas ragged dot whose time the model gives most to grid-step cost.

    Says how far the fitted step cost has been tested: a layer of near-empty steps is outside that range.
    """
    report = json.loads(calibration_bands.CALIBRATION.read_text())
    best = {}
    for entry in report["entries"]:
        if entry["kind"] != "pallas_ragged_dot":
            continue
        share = entry["terms_us"]["kernel_steps"] * grid_step_s(entry["chip"]) * 1e6 / entry["measured_us"]
        if entry["chip"] not in best or share > best[entry["chip"]]["share"]:
            best[entry["chip"]] = {"share": round(share, 4), "call": entry["call"], "config": entry["config"],
                                   "steps": entry["terms_us"]["kernel_steps"], "measured_us": entry["measured_us"],
                                   "ratio": entry["ratio"]}
    return best
