"""held_out.json -> benchmarks/README.md's held-out checks: each public timing, the model's price and their ratio."""

from __future__ import annotations


def _shapes(check: dict) -> str:
    if check["kind"] == "copy":
        return check["what"]
    return (f"{check['kernel']}: E={check['experts']}, {check['k']}x{check['n']} {check['dtype']}, "
            f"{check['touched']} groups x {check['rows']} rows")


def checks(report: dict) -> str:
    """The copy and weight-streaming checks: measured, modelled (at the priced share), predicted / measured."""
    rows = ["| source | chip | what, shapes | measured | modelled (HBM share priced) | predicted / measured |",
            "| --- | --- | --- | ---: | ---: | ---: |"]
    for check in report["checks"]:
        if check["kind"] == "copy":
            measured = f"{check['measured_bytes_per_s'] / 1e12:.2f} TB/s"
            modelled = f"{check['modelled_bytes_per_s'] / 1e12:.2f} TB/s ({check['hbm_share']:g})"
        elif check["kind"] == "weight_streaming":
            measured = f"{check['measured_us']:.1f} µs"
            modelled = f"{check['modelled_us']:.1f} µs, the floor ({check['hbm_share']:g})"
        else:
            continue
        rows.append(f"| {check['source']} | {check['chip']} | {_shapes(check)} | {measured} | {modelled} "
                    f"| {check['ratio']:.3f} |")
    return "\n".join(rows)


def calibrated(report: dict) -> str:
    """tokamax timings no fit used, priced by calibrate: count, error spread, signed bias, the extremes."""
    rows = ["| source | chip, kind | priced | skipped (why) | median \\|ratio - 1\\| | 90th pct | signed bias, median "
            "| lowest / highest ratio |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for check in report["checks"]:
        if check["kind"] != "calibrate" or not check["count"]:
            continue
        ratios = [e["ratio"] for e in check["entries"]]
        skipped = "; ".join(f"{n} ({why})" for why, n in check["skipped"].items()) or "none"
        rows.append(f"| {check['source']} | {', '.join(check['chips'])} {', '.join(check['kinds'])} | {check['count']} "
                    f"| {skipped} | {100 * check['median_abs_error']:.1f} % | {100 * check['p90_abs_error']:.1f} % "
                    f"| {100 * check['median_signed']:+.1f} % | {min(ratios):.2f} / {max(ratios):.2f} |")
    return "\n".join(rows)


def left_out(report: dict) -> str:
    return "\n".join(f"- {item['source']} ({item['chip']}): {item['what']}: {item['why']}" for item in report["left_out"])


def render_markdown(report: dict) -> dict[str, str]:
    return {"checks": checks(report), "calibrated": calibrated(report), "left-out": left_out(report)}
