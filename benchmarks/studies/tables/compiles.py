"""compiles.json -> the first-call table: distinct kernel shapes and their compile seconds, before and after the
buckets, beside the XLA programs the buckets' own pads and slices add (`after.bucketing_programs`), per model,
workload and TPU generation."""

from __future__ import annotations

from . import markdown_table


def seconds(summary: dict) -> str:
    """Compile seconds of a workload, with the share priced by interpolation rather than compiled."""
    total = summary["total_s"]
    share = summary["extrapolated_s"] / total if total else 0.0
    return f"{total:,.0f}" + (f" ({100 * share:.0f} % interpolated)" if share >= 0.005 else "")


def bucketing_cells(before: dict, after: dict) -> list[str]:
    """The pad and slice programs' count and seconds, and the first request's compiles, kernels + pads."""
    programs = after["bucketing_programs"]
    return [f"{programs['distinct_shapes']:,}", seconds(programs),
            f"{before['first_call_s']:,.0f} / {after['first_call_s']:,.0f} + {programs['first_call_s']:,.0f}"]


def first_call(data: dict) -> str:
    load = f"wall seconds on {data['cpu_count']} cores at load average {data['load_average_at_start'][0]:.0f}"
    rows = []
    for model, generations in data["models"].items():
        for generation, workloads in generations.items():
            for workload, modes in workloads.items():
                before, after = modes["before"], modes["after"]
                rows.append([model, workload, generation, f"{before['distinct_shapes']:,}",
                             f"{after['distinct_shapes']:,}", seconds(before), seconds(after),
                             *bucketing_cells(before, after)])
    return markdown_table(["model", "workload", "gen", "kernel shapes, no buckets", "with buckets",
                           f"compile s, no buckets ({load})", "with buckets",
                           "pad and slice programs the buckets add", "their compile s",
                           "first request's compiles, s: no buckets / buckets, kernels + pads"],
                          "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", rows)


def end_to_end(data: dict) -> str:
    """Every program of a whole generate under TorchTPU's strict eager, by whose op, per model and cache."""
    counts = data["end_to_end"]
    rows = []
    for model, caches in counts["models"].items():
        for cache, measured in caches.items():
            for moment, by_origin in measured.items():
                rows.append([model, cache, moment.replace("_", " "),
                             *(f"{by_origin[kind]:,.1f}".removesuffix(".0") for kind in by_origin)])
    kinds = list(next(iter(next(iter(counts["models"].values())).values()))["first_request"])
    return markdown_table(["model", "cache", f"programs (prompts {counts['prompts']}, {counts['new_tokens']} new "
                                             "tokens each)", *kinds],
                          "| --- | --- | --- |" + " ---: |" * len(kinds), rows)


RECIPE = "static at a key bucket (the recipe)"
RECIPE_MODEL = "Qwen3-30B-A3B"  # the model of the README's steady-state step
TPU_ORIGINS = ("our kernels", "our other ops", "transformers", "other")  # the recipe's prompt padding runs on the host


def recipe_line(data: dict, model: str = RECIPE_MODEL, generation: str = "v6e") -> str:
    """One line: the first-call cost of kernelize's TPU recipe for `model` beside its steady state, from the
    end-to-end counts and the kernels' measured compile seconds (`generation`)."""
    counts = data["end_to_end"]
    recipe = counts["models"][model][RECIPE]

    def programs(moment: str) -> float:
        return sum(recipe[moment][origin] for origin in TPU_ORIGINS)

    first, kernels = programs("first_request"), recipe["first_request"]["our kernels"]
    compiled = data["models"][model][generation]["generate"]["after"]
    longest = max(data["workloads"]["generate"]["prompt_lengths"])
    return (f"First call against steady state ({model} with kernelize's TPU recipe, programs counted under TorchTPU's "
            f"strict eager): the first request ({counts['prompts'][0]}-token prompt, {counts['new_tokens']} new "
            f"tokens) compiles {first:,.0f} programs, {kernels:,.0f} of them kernels ({generation}: "
            f"{compiled['first_call_s']:,.0f} s of kernel compiles for a first request, {compiled['total_s']:,.0f} s "
            f"for every bucket of prompts up to {longest:,} tokens, which `precompile` pays up front) and "
            f"{first - kernels:,.0f} eager ops of ours and transformers' (counted, not timed); a later request "
            f"{programs('later_requests_per_request'):,.0f} on average (prompts up to {max(counts['prompts']):,} "
            f"tokens: new buckets); a decode step after the first "
            f"{programs('forward_per_decode_step_after_the_first'):,.0f}.")


def render_markdown(data: dict) -> dict[str, str]:
    """compiles.json's tables by section."""
    sections = {"first-call": first_call(data)}
    if "end_to_end" in data:
        sections["end-to-end"] = end_to_end(data)
        if RECIPE in data["end_to_end"]["models"].get(RECIPE_MODEL, {}) and RECIPE_MODEL in data["models"]:
            sections["recipe"] = recipe_line(data)
    return sections
