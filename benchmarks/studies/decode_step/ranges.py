"""The step's ratio over the terms no timing identifies, for our experts kernel and for HF's own, in HF's configuration.

Three terms of the modelled step rest on no measurement of their own kind on a v6e:

- the cost of one Pallas grid step on v6e: v5e's fitted value, borrowed (tokamax's v6e timings of its Pallas ragged
  dot trade it against the HBM share at almost the same error: calibration_fit_v6e.json). HF's measured 257 us
  layer implies about
  0.024 us (moe_layer.json `hf_257us`) and HF's measured step allows at most the bound in `hf_kernel_check`, so
  the range runs from just under the first to the fitted value (`GRID_STEP_RANGE_US`);
- the share of the peak HBM bandwidth the copies reach: clamped at 1 on v5e's two weight-streaming timings; the
  weight-streaming calls measured on v5e and TPU7x reach about 0.9 and 0.78 of the peak (`HBM_SHARE_RANGE`);
- batched_mm's XLA gathers and batched matvecs on the default path: priced by their bytes at the HBM rate, a floor
  that no TPU timing checks. Their upper end here is the multiplier that makes Qwen3's modelled default step equal
  the one HF's own figures imply (its measured kernelized step times its measured ratio); Gemma 4 takes the same
  multiplier (the same ops, no measured step of its own).

Each kernel term's time is its step cost plus the rest, which scales with 1 / share like every other term priced by
its bytes (a decode step streams: its copies outlast its matmuls); the all-reduce, priced by the ICI formula, does
not move. A term's grid steps are the count its pricing recorded (`grid_steps`, per call). Pure arithmetic on the
JSON's term rows: tested without compiling anything.
"""

from __future__ import annotations

import itertools

from .step import DEFAULT, HF_PATH

# Source: the audit in issue #62 and benchmarks/studies/robustness.py; see the module docstring.
GRID_STEP_RANGE_US = (0.02, 0.34)
HBM_SHARE_RANGE = (0.78, 1.0)
BATCHED_MM = "batched_mm"
ICI_KIND = "formula (ICI hop latency band)"
OURS, HF_KERNEL = "ours", "hf_kernel"
TERM_NAMES = {"grid_step_us": "the grid-step cost", "hbm_share": "the HBM share",
              "batched_mm_scale": "batched_mm's multiplier"}


def term_ms(term: dict, *, grid_step_us: float, fitted_step_us: float, share_scale: float,
            batched_mm_scale: float = 1.0) -> float:
    """One term's ms per step at a grid-step cost, an HBM share (as fitted / assumed) and a batched_mm multiplier."""
    if term["error_kind"] == ICI_KIND:
        return term["ms_per_step"]
    steps_ms = term.get("grid_steps", 0) * term["per_step"] / 1e3
    rest = (term["ms_per_step"] - steps_ms * fitted_step_us) * share_scale
    if term["term"].startswith(BATCHED_MM):
        rest *= batched_mm_scale
    return rest + steps_ms * grid_step_us


def path_ms(terms: list[dict], **at) -> float:
    return sum(term_ms(t, **at) for t in terms)


def with_hf_kernel(terms: list[dict], check: dict, layers: int) -> list[dict]:
    """HF's configuration with HF's experts kernel (tokamax's at its default tiles: moe_layer's `tokamax_default`
    row, `hf_kernel_check`) in place of ours."""
    swapped = [t for t in terms if not t["term"].startswith("experts: our")]
    swapped.append({"term": "experts: HF's kernel (tokamax at its default tiles)", "per_step": layers,
                    "ms_per_step": check["tokamax_default_us"] * layers / 1e3, "error_kind": "pallas_ragged_dot",
                    "grid_steps": check["tokamax_default_grid_steps"]})
    return swapped


def batched_mm_scale_implied(default: list[dict], implied_default_ms: float, fitted_step_us: float) -> float:
    """The multiplier on batched_mm's terms that makes the modelled default step `implied_default_ms`."""
    at = {"grid_step_us": fitted_step_us, "fitted_step_us": fitted_step_us, "share_scale": 1.0}
    rest = sum(term_ms(t, **at) for t in default if not t["term"].startswith(BATCHED_MM))
    batched = sum(term_ms(t, **at) for t in default if t["term"].startswith(BATCHED_MM))
    return (implied_default_ms - rest) / batched


def ratio_ranges(paths: dict, check: dict, layers: int, fitted_step_us: float, fitted_share: float,
                 batched_mm_upper: float) -> dict:
    """Per kernelized path (ours, HF's kernel): the step and its ratio to the default at the fitted constants, and
    the ratio's range over each unidentified term alone and over all three at once (the corners)."""
    kernelized = {OURS: paths[HF_PATH]["terms"], HF_KERNEL: with_hf_kernel(paths[HF_PATH]["terms"], check, layers)}
    default = paths[DEFAULT]["terms"]
    ranges = {"grid_step_us": GRID_STEP_RANGE_US, "hbm_share": HBM_SHARE_RANGE,
              "batched_mm_scale": (1.0, round(batched_mm_upper, 3))}
    central = {"grid_step_us": fitted_step_us, "hbm_share": fitted_share, "batched_mm_scale": 1.0}

    def at(point: dict) -> dict:
        return {"grid_step_us": point["grid_step_us"], "fitted_step_us": fitted_step_us,
                "share_scale": fitted_share / point["hbm_share"], "batched_mm_scale": point["batched_mm_scale"]}

    found = {"ranges": {name: list(bounds) for name, bounds in ranges.items()}, "central": central, "paths": {}}
    for name, terms in kernelized.items():
        # HF's configuration has no batched_mm term: the multiplier moves the default step only.
        def ratio(point: dict, terms=terms) -> float:
            return path_ms(default, **at(point)) / path_ms(terms, **at(point))

        steps = [path_ms(terms, **at({**central, "grid_step_us": g, "hbm_share": s}))
                 for g, s in itertools.product(ranges["grid_step_us"], ranges["hbm_share"])]
        alone = {}
        for term_name, bounds in ranges.items():
            values = [ratio({**central, term_name: bound}) for bound in bounds]
            alone[term_name] = [round(min(values), 2), round(max(values), 2)]
        corners = [ratio(dict(zip(ranges, point))) for point in itertools.product(*ranges.values())]
        found["paths"][name] = {"step_ms": round(path_ms(terms, **at(central)), 2),
                                "step_ms_range": [round(min(steps), 2), round(max(steps), 2)],
                                "ratio": round(ratio(central), 2), "ratio_alone": alone,
                                "ratio_all": [round(min(corners), 2), round(max(corners), 2)]}
    return found


# Ours "lands near" HF's measured ratio within this share of it.
NEAR = 0.25


def explain(result: dict) -> list[str]:
    """In words: the ratio with HF's own kernel beside ours', over the unidentified terms, against HF's measured."""
    found = result.get("ratio_ranges")
    if not found:
        return []
    ours, hf = found["paths"][OURS], found["paths"][HF_KERNEL]
    measured = result["comparison"]["hf_measured_ratio"]
    near = abs(ours["ratio"] / measured - 1) <= NEAR
    alone = {name: bounds[1] for name, bounds in hf["ratio_alone"].items()}
    reach = [name for name, high in alone.items() if high >= measured]
    how = (f"{' or '.join(TERM_NAMES[name] for name in reach)} alone brings it there" if reach else
           f"no term alone brings it there (at most {max(alone.values()):.1f}x); "
           + ("all of them at once can" if hf["ratio_all"][1] >= measured else "nor do all of them at once"))
    return [
        f"HF measured its ratio with its own experts kernel. In the same modelled step that kernel (tokamax at its "
        f"default tiles) gives {hf['ratio']:.1f}x ({hf['ratio_all'][0]:.1f}-{hf['ratio_all'][1]:.1f}x over the "
        f"unidentified terms, `ranges`), ours {ours['ratio']:.1f}x ({ours['ratio_all'][0]:.1f}-"
        f"{ours['ratio_all'][1]:.1f}x), against HF's {measured}x"
        + (": our kernel's ratio lands near HF's measured one while HF's kernel, the one HF ran, lands at "
           f"{hf['ratio'] / measured:.2f} of it, so the agreement is a cancellation, not a check" if near else "")
        + f". For HF's kernel's ratio to meet HF's measured one, {how}"]
