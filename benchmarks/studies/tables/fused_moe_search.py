"""fused_moe_search.json -> its study page's tables: vLLM's fused_ep_moe at its own block sizes and at the best."""

from __future__ import annotations


def blocks(sizes: dict | None) -> str:
    return "/".join(str(sizes[name]) for name in ("bt", "btc", "bf", "bd1", "bd2")) if sizes else "none"


def anchor(data: dict) -> str:
    """Per generation at the anchor shape: the layer compiled at vLLM's pick and at the best, µs."""
    found = data["anchor"]
    rows = [f"| {found['label']} | vLLM's pick µs | searched best µs | best bt/btc/bf/bd1/bd2 |",
            "| --- | ---: | ---: | --- |"]
    generations = list(dict.fromkeys(entry["generation"] for entry in data["shapes"]))  # the run's order
    for generation, layer in sorted(found["per_generation"].items(), key=lambda item: generations.index(item[0])):
        best = f"{layer['best_layer_us']:.1f}" if layer["best_layer_us"] is not None else f"none: {layer['error']}"
        vllm = f"{layer['vllm_layer_us']:.1f}" if layer["vllm_layer_us"] is not None else "refused"
        rows.append(f"| {generation} | {vllm} | {best} | {blocks(layer['best_block_sizes'])} |")
    return "\n".join(rows)


def cell(entry: dict) -> str:
    vllm = entry["vllm"]
    before = (f"{vllm['standalone_us']:.1f}" + ("" if vllm["fits_vmem"] else " (over the VMEM budget)")
              if vllm["standalone_us"] is not None else "refused")
    if "best" not in entry:
        return f"{before} -> none fits"
    return f"{before} -> {entry['best']['standalone_us']:.1f}, {blocks(entry['best']['block_sizes'])}"


def search(data: dict) -> str:
    """Per shape and generation: the kernel alone at vLLM's pick -> at the best searched (its blocks), µs."""
    generations = list(dict.fromkeys(entry["generation"] for entry in data["shapes"]))
    by_shape: dict[str, dict] = {}
    for entry in data["shapes"]:
        if entry["configs_accepted"]:
            by_shape.setdefault(entry["label"], {})[entry["generation"]] = entry
    rows = ["| shape | " + " | ".join(f"{g}: vLLM's pick -> best µs, bt/btc/bf/bd1/bd2" for g in generations) + " |",
            "| --- |" + " --- |" * len(generations)]
    rows += [f"| {label} | " + " | ".join(cell(per[g]) for g in generations) + " |" for label, per in by_shape.items()]
    refused = sorted({entry["label"] for entry in data["shapes"] if not entry["configs_accepted"]})
    return "\n".join(rows) + "\n\nThe kernel accepts no block sizes at: " + ", ".join(refused) + "."


def render_markdown(data: dict) -> dict[str, str]:
    return {"anchor": anchor(data), "search": search(data)}
