"""robustness.json -> its study page's tables, opening with one-line verdicts."""

from __future__ import annotations

from collections import Counter

BACKWARD_FAMILIES = ("moe_backward ranking", "backward/forward ratio")
FAMILIES = ("moe_layer ranking", "anchor", "paged decode", "decode step", *BACKWARD_FAMILIES, "mla ranking", "mla form")
# The verdicts: one line per study (the MLA claims are in the summary below them).
VERDICT_LINES = (("moe_layer ranking", "anchor"), ("paged decode",), ("decode step",), BACKWARD_FAMILIES)


def nearest_flips(claims: list[dict]) -> dict[str, float]:
    """Per constant, the value nearest its fitted one at which one of `claims` flips."""
    flips: dict[str, float] = {}
    for claim in claims:
        for name, entry in claim["by_constant"].items():
            if entry["flips_at"] is not None:
                fitted = entry["fitted"]
                if name not in flips or abs(entry["flips_at"] - fitted) < abs(flips[name] - fitted):
                    flips[name] = entry["flips_at"]
    return flips


def summary(report: dict) -> str:
    """Per family of claims and generation: how many hold across the ranges, how many flip, and the flip nearest
    the fitted constants."""
    rows = ["| claims | gen | robust | fragile | what flips them (the value nearest the fitted one) |",
            "| --- | --- | ---: | ---: | --- |"]
    counts = Counter((c["family"], c["generation"], c["verdict"]) for c in report["claims"])
    for family in FAMILIES:
        for generation in sorted({c["generation"] for c in report["claims"] if c["family"] == family}):
            flips = nearest_flips([c for c in report["claims"]
                                   if (c["family"], c["generation"]) == (family, generation)])
            what = ", ".join(f"{name} at {value:g}" for name, value in sorted(flips.items())) or "nothing in range"
            rows.append(f"| {family} | {generation} | {counts[(family, generation, 'robust')]} | "
                        f"{counts[(family, generation, 'fragile')]} | {what} |")
    return "\n".join(rows)


def fragile(report: dict) -> str:
    """Every fragile claim but the paged ones (summarised above): its figure, and where it flips."""
    header = ["| claim | gen | at the fitted constants | worst point | flips at |",
              "| --- | --- | ---: | ---: | --- |"]
    shown = [c for c in report["claims"] if c["verdict"] == "fragile" and c["family"] != "paged decode"]
    return "\n".join(header + [f"| {c['claim']} | {c['generation']} | {c['fitted']:g} | "
                               f"{c['worst_point']['value']:g} | {'; '.join(c['flips'])} |" for c in shown])


def constants(report: dict) -> str:
    """The ranges priced, and what v6e's own timings say of its grid-step cost and HBM share."""
    data = report["v6e_grid_step_data"]
    c = report["constants"]
    copy_high = ", ".join(f"{g} {v:g}" for g, v in c["copy_issue_us"]["range_high"].items())
    fits = ", ".join(f"{v:g}" for v in data["fit_from_hf_257us_us"].values())
    tokamax = report["v6e_tokamax_data"]
    share = (f"tokamax's v6e weight-streaming timings fit {tokamax['hbm_share']:g} ({tokamax['hbm_share_timings']} "
             "timings)" if tokamax["hbm_share"] else "none bound by weight streaming")
    lowest, highest = tokamax["best_share_across_step_range"]
    return "\n".join([
        "| constant | priced at | range | v6e data |", "| --- | --- | --- | --- |",
        f"| HBM share | {', '.join(f'{g} {v:g}' for g, v in c['hbm_share']['fitted'].items())} | "
        f"{c['hbm_share']['range'][0]:g}-{c['hbm_share']['range'][1]:g} | {share} |",
        f"| v6e grid step (us) | {data['fitted_us']:g} (v6e's data; {data['borrowed_until_now_us']:g}, v5e's, "
        f"borrowed before) | {data['range_priced_us'][0]:g}-{data['range_priced_us'][1]:g} | HF's layer fits {fits} "
        f"(one timing); HF's step bounds it at {data['bound_from_hf_step_us']:g} "
        f"({data['bound_from_hf_step_with_host_us']:g} with the host cost); tokamax's v6e Pallas timings fit "
        f"{tokamax['grid_step_fit_alone_us']:g} alone, but across the range a share of {lowest:g}-{highest:g} fits "
        f"them about as well (median log error {tokamax['fit_error_across_step_range'][0]:g}-"
        f"{tokamax['fit_error_across_step_range'][1]:g}): not identified by them |",
        f"| cost per issued copy (us) | 0 | 0 to {copy_high} | none |",
    ])


def flipped(report: dict) -> str:
    """Per family, how many v6e claims hold at the constants v6e borrowed before its own data priced it, and each
    claim whose outcome differs there from here (it flipped with the new prices)."""
    claims = [c for c in report["claims"] if "at_borrowed" in c]
    point = ", ".join(f"{name} {value:g}" for name, value in
                      max((c["at_borrowed"]["constants"] for c in claims), key=len, default={}).items())
    rows = [f"v6e's claims at the constants it borrowed from v5e before its own data priced it ({point}), against "
            "the fitted ones:", "",
            "| claims | same outcome | flipped | flipped: claim, at the borrowed constants -> at the fitted |",
            "| --- | ---: | ---: | --- |"]
    for family in FAMILIES:
        found = [c for c in claims if c["family"] == family]
        if not found:
            continue
        changed = [c for c in found if c["at_borrowed"]["holds"] != c["holds_at_fitted"]]
        shown = "; ".join(f"{c['claim']}, {c['at_borrowed']['value']:g} -> {c['fitted']:g}" for c in changed)
        rows.append(f"| {family} | {len(found) - len(changed)} | {len(changed)} | {shown or 'none'} |")
    return "\n".join(rows)


def backward(report: dict) -> str:
    """Every moe_backward claim, robust or fragile: the ragged-dot card's backward section."""
    rows = ["| claim | gen | verdict | at the fitted constants | worst point | flips at |",
            "| --- | --- | --- | ---: | ---: | --- |"]
    rows += [f"| {c['claim']} | {c['generation']} | {c['verdict']} | {c['fitted']:g} | {c['worst_point']['value']:g} "
             f"| {'; '.join(c['flips']) or '-'} |" for c in report["claims"] if c["family"] in BACKWARD_FAMILIES]
    return "\n".join(rows)


def verdicts(report: dict) -> str:
    """One line per study (`VERDICT_LINES`), a fragile one pointing to the JSON that lists each claim."""
    lines = []
    for families in VERDICT_LINES:
        counts, fragile_any = [], False
        for family in families:
            found = [c for c in report["claims"] if c["family"] == family]
            robust = sum(c["verdict"] == "robust" for c in found)
            fragile_any |= robust < len(found)
            counts.append(f"{family}: {robust} of {len(found)} claims robust"
                          + ("" if robust == len(found) else f", fragile: {len(found) - robust}"))
        lines.append("- " + "; ".join(counts) + (" (each in robustness.json's claims)" if fragile_any else ""))
    for model, rests in report["decode_step_rests_on"].items():
        lines.append(f"- {model} whole-step ratio {rests['ratio']:g}x: "
                     f"{100 * rests['uncalibrated_share_of_default']:.1f} % of the default step and "
                     f"{100 * rests['uncalibrated_share_of_hf_configuration']:.1f} % of HF's "
                     f"configuration are XLA programs no timing checks (batched_mm alone "
                     f"{100 * rests['batched_mm_share_of_default']:.0f} % of the default)"
                     + (f"; HF's ratio implies a {rests['hf_implied_default_ms']:g} ms default step, modelled "
                        f"{rests['modelled_default_device_ms']:g} ms" if rests["hf_implied_default_ms"] else ""))
    return "\n".join(lines)


def render_markdown(report: dict) -> dict[str, str]:
    return {"verdicts": verdicts(report), "summary": summary(report), "constants": constants(report),
            "fragile": fragile(report), "flipped": flipped(report), "backward": backward(report)}
