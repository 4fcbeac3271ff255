"""What the rows add up to: per (model, call, generation) the table's figures, per (model, generation) where the
absorbed form stops being the cheaper one, and where the kernel's rule picks otherwise than the model's prices.
Pure arithmetic on rows (`measure.measure`), tested without compiling anything."""

from __future__ import annotations

import math


def _us(found: dict | None) -> float | None:
    if not found or "us" not in found or found["us"] != found["us"]:
        return None
    return found["us"]


def table_row(row: dict) -> dict:
    """One line of the table: every path's µs, ours over transformers' and over the floor."""
    rival = row.get("vllm_mla") or {}
    ours = row.get("ours_us")
    line = {"model": row["model"], "call": row["call"], "generation": row["generation"],
            "floor_us": row["floor"]["us"], "transformers_us": _us(row["transformers"]),
            "absorbed_us": _us(row["absorbed"]), "expanded_us": _us(row["expanded"]),
            "model_pick": row.get("model_pick"), "rule_pick": row["rule"]["pick"], "ours_us": ours,
            "ours_band_p90_us": row[row["model_pick"]]["band_p90_us"] if row.get("model_pick") else None,
            "vllm_us": _us(rival.get("best")), "vllm_default_us": _us(rival.get("default")),
            "expanded_stand_in": any("stand_in" in t for t in row["expanded"]["terms"])}
    if ours:
        if row["kind"] == "decode":  # a prefill is bound by its matmuls, not by reading the cache
            line["ours_over_floor"] = ours / row["floor"]["us"]
        if line["transformers_us"]:
            line["transformers_over_ours"] = line["transformers_us"] / ours
        if line["vllm_us"]:
            line["ours_over_vllm"] = ours / line["vllm_us"]
    return line


def crossovers(rows: list[dict]) -> list[dict]:
    """Per (model, generation): the calls in order of queries per sequence, each form's µs, and between which two the
    priced winner changes (the crossover), for the model's prices and the rule's picks."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get("model_pick"):
            groups.setdefault((row["model"], row["generation"]), []).append(row)
    found = []
    for (model, generation), group in sorted(groups.items()):
        ordered = sorted(group, key=lambda r: (r["q_len"], r["kv_len"], r["batch"]))
        entry = {"model": model, "generation": generation,
                 "calls": [{"call": r["call"], "absorbed_us": r["absorbed"]["us"], "expanded_us": r["expanded"]["us"],
                            "model_pick": r["model_pick"], "rule_pick": r["rule"]["pick"]} for r in ordered]}
        for who in ("model_pick", "rule_pick"):
            switches = [f"{a['call']} -> {b['call']}" for a, b in zip(entry["calls"], entry["calls"][1:])
                        if a[who] and b[who] and a[who] != b[who]]
            entry[f"{who.split('_')[0]}_switches"] = switches
        found.append(entry)
    return found


def disagreements(rows: list[dict]) -> list[dict]:
    """The calls where the kernel's rule picks the form the model prices dearer, and by how much."""
    found = []
    for row in rows:
        if row.get("rule_agrees") is False:
            picked, best = row[row["rule"]["pick"]]["us"], row[row["model_pick"]]["us"]
            found.append({"model": row["model"], "call": row["call"], "generation": row["generation"],
                          "rule_pick": row["rule"]["pick"], "model_pick": row["model_pick"],
                          "rule_pick_over_best": picked / best})
    return found


def summarise(rows: list[dict]) -> dict:
    lines = [table_row(row) for row in rows]
    ratios = [line["transformers_over_ours"] for line in lines if line.get("transformers_over_ours")]
    rule_known = [row for row in rows if row.get("rule_agrees") is not None]
    return {
        "rows": lines,
        "crossovers": crossovers(rows),
        "rule_checked": len(rule_known),
        "rule_disagreements": disagreements(rows),
        "rule_missing": next((row["rule"].get("why") for row in rows if row["rule"]["pick"] is None), None),
        "transformers_over_ours_range": [min(ratios), max(ratios)] if ratios else None,
        "geomean_transformers_over_ours": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
    }
