"""The README's speed picture, drawn from the studies' JSON: per model and chip, our modelled time against
transformers' default path (what a user runs without kernelize) and the best rival, each with its calibrated p90
band, the claims `robustness` finds fragile marked.

One headline per model, the call that dominates its decode step:

- MoE models without latent attention: one experts layer at decode, 64 tokens on an EP8 rank (Hugging Face's
  measured batch, `decode_step`'s experts case). `decode_step` finds transformers' batched_mm experts most of the
  default step. Ours and the best tuned rival come from `moe_layer` (v5e and v6e from its default run, v5p and
  TPU7x from its `--generations v5p tpu7x` run); the default path's experts from `decode_step`, which prices the
  default path on v6e only.
- MLA models: one MLA layer's attention at decode, a batch of 64 over 4096 cached tokens (`mla`): transformers
  re-expands the latent cache at every call, so attention, not the experts, is where its default path spends.

`bars(root)` gathers the figures (`benchmarks/results/speed.md` lists them, the picture draws them);
`inputs_digest` is what the PNG carries in its metadata, so `bench report --check` can tell a picture drawn from
the current JSON (and this module) from a stale one without comparing pixels.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from benchmarks.studies.tables import markdown_table

GENERATIONS = ("v5e", "v5p", "v6e", "tpu7x")
GENERATION_NAMES = {"v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "TPU7x"}
# moe_layer's runs: which generations each holds.
MOE_LAYER_RUNS = {"moe_layer.json": ("v5e", "v6e"), "moe_layer_v5p_tpu7x.json": ("v5p", "tpu7x")}
MLA_CALL = "decode B=64 cache=4096"
PATHS = ("default", "ours", "rival")
# The PNG's text chunk holding `inputs_digest`.
DIGEST_KEY = "tpu-kernels-inputs-sha256"


@dataclass(frozen=True)
class Headline:
    model: str       # the study's key for it
    name: str        # as the picture names it
    kind: str        # "experts" (moe_layer's case `case`) or "mla" (mla's model `model`, call MLA_CALL)
    case: str = ""


HEADLINES = (
    Headline("qwen3-30b-a3b", "Qwen3-30B-A3B", "experts", "qwen3-30b-a3b EP8 router-masking T=64"),
    Headline("gemma-4-26b-a4b", "Gemma 4 26B-A4B", "experts", "gemma-4-26b-a4b EP8 router-masking T=64"),
    Headline("gpt-oss-20b", "GPT-OSS-20B", "experts", "gpt-oss-20b EP8 dispatch T=64"),
    Headline("deepseek-v3", "DeepSeek-V3 (data-parallel attention)", "mla"),
    Headline("moonlight-16b-a3b", "Moonlight-16B-A3B (16 heads per chip)", "mla"),
    Headline("glm-4.7-flash", "GLM-4.7-Flash", "mla"),
)
KIND_TITLES = {"experts": "one experts layer, decode, 64 tokens on an EP8 rank",
               "mla": "one MLA layer's attention, decode, batch 64 over 4096 cached tokens"}


class MissingFigure(ValueError):
    """A figure the picture needs is not in the studies' JSON: the message says which."""


def _load(root: Path, name: str) -> dict:
    return json.loads((root / "benchmarks" / "results" / name).read_text())


def _bar(path: str, name: str, us: float, band) -> dict:
    return {"path": path, "name": name, "us": round(us, 2), "band_p90_us": [round(v, 2) for v in band] if band else None}


def _fragile(claims: list[dict], family: str, prefix: str, generation: str) -> list[str]:
    return sorted(c["claim"] for c in claims if c["family"] == family and c["generation"] == generation
                  and c["claim"].startswith(prefix) and c["verdict"] == "fragile")


def default_experts_us(decode_step: dict, headline: Headline) -> dict[str, float]:
    """transformers' batched_mm experts, µs per layer, by generation: `decode_step`'s default path (v6e only)."""
    model = decode_step["models"].get(headline.model)
    if model is None:
        return {}
    if model["hf_kernel_check"]["experts_case"] != headline.case:
        raise MissingFigure(f"decode_step's experts case for {headline.model} is "
                            f"{model['hf_kernel_check']['experts_case']}, not {headline.case}")
    terms = model["paths"]["transformers_default"]["terms"]
    return {decode_step["method"]["generation"]: sum(t["us_per_call"] for t in terms
                                                     if t["term"].startswith("batched_mm:"))}


def experts_bars(root: Path, headline: Headline, claims: list[dict]) -> list[dict]:
    default = default_experts_us(_load(root, "decode_step.json"), headline)
    found = []
    for run, generations in MOE_LAYER_RUNS.items():
        data = _load(root, run)
        shapes = {(s["label"], s["generation"]): s for s in data["shapes"]}
        variants = {(v["label"], v["generation"], v["variant"]): v for v in data["variants"]}
        for generation in generations:
            shape = shapes.get((headline.case, generation))
            if shape is None or shape.get("best_rival") is None:
                raise MissingFigure(f"{run} has no line with a best rival for {headline.case} on {generation}")
            rival = variants[headline.case, generation, shape["best_rival"]]
            bars = [_bar("ours", "ours", shape["ours_us"], shape["ours_band_p90_us"]),
                    _bar("rival", shape["best_rival"], shape["best_rival_us"], rival.get("band_p90_us"))]
            if generation in default:
                bars.insert(0, _bar("default", "transformers' batched_mm", default[generation], None))
            found.append({"generation": generation, "bars": bars,
                          "fragile": _fragile(claims, "moe_layer ranking", f"{headline.case}:", generation)})
    return sorted(found, key=lambda point: GENERATIONS.index(point["generation"]))


def mla_bars(root: Path, headline: Headline, claims: list[dict]) -> list[dict]:
    found = []
    for line in _load(root, "mla.json")["results"]:
        if line["model"] != headline.model or line["call"] != MLA_CALL:
            continue
        ours = line[line["model_pick"]]
        bars = [_bar("default", "transformers' re-expansion", line["transformers"]["us"], None),
                _bar("ours", f"ours ({line['model_pick']})", line["ours_us"], ours.get("band_p90_us"))]
        best = line["vllm_mla"].get("best")
        if best:
            bars.append(_bar("rival", "vLLM MLA v2", best["us"], best.get("band_p90_us")))
        found.append({"generation": line["generation"], "bars": bars,
                      "fragile": _fragile(claims, "mla ranking", f"{headline.model} {MLA_CALL}:", line["generation"])})
    if not found:
        raise MissingFigure(f"mla.json has no {MLA_CALL} line for {headline.model}")
    return sorted(found, key=lambda point: GENERATIONS.index(point["generation"]))


def bars(root: Path) -> list[dict]:
    """Per headline (`HEADLINES`): per generation it is priced on, the default path's, our and the best rival's
    µs with their p90 bands (None: no band), and the robustness claims at that point that are fragile."""
    claims = _load(root, "robustness.json")["claims"]
    panels = []
    for headline in HEADLINES:
        gather = experts_bars if headline.kind == "experts" else mla_bars
        panels.append({"model": headline.name, "kind": headline.kind, "case": headline.case or MLA_CALL,
                       "points": gather(root, headline, claims)})
    return panels


def inputs_digest(panels: list[dict]) -> str:
    """sha256 of the figures drawn and of this module's source: a picture carrying it was drawn from them."""
    digest = hashlib.sha256(json.dumps(panels, sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def stored_digest(path: Path) -> str | None:
    """The `DIGEST_KEY` text chunk of the PNG at `path` (None: no such file or chunk)."""
    if not path.is_file():
        return None
    data = path.read_bytes()
    position = 8  # past the PNG signature
    while position + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        if kind == b"tEXt" and b"\0" in body:
            key, _, text = body.partition(b"\0")
            if key.decode("latin-1") == DIGEST_KEY:
                return text.decode("latin-1")
        elif kind == b"zTXt" and b"\0" in body:
            key, _, rest = body.partition(b"\0")
            if key.decode("latin-1") == DIGEST_KEY:
                return zlib.decompress(rest[1:]).decode("latin-1")
        position += 12 + length
    return None


def _cell(bar: dict | None) -> str:
    if bar is None:
        return "not modelled"
    band = bar["band_p90_us"]
    return f"{bar['us']:,.1f} ({band[0]:,.1f}-{band[1]:,.1f})" if band else f"{bar['us']:,.1f} (no band)"


def render_markdown(panels: list[dict]) -> dict[str, str]:
    """The picture's figures as a table: per model and chip, each path's µs (p90 band), the rival's name, and the
    fragile claims."""
    rows = []
    for panel in panels:
        for point in panel["points"]:
            by_path = {bar["path"]: bar for bar in point["bars"]}
            rival = by_path.get("rival")
            rows.append([panel["model"], panel["case"], GENERATION_NAMES[point["generation"]],
                         _cell(by_path.get("default")), _cell(by_path["ours"]),
                         f"{rival['name']}: {_cell(rival)}" if rival else "not modelled",
                         "; ".join(point["fragile"]) or "none"])
    table = markdown_table(["model", "headline call", "gen", "default path µs (p90 band)", "ours µs (p90 band)",
                            "best rival µs (p90 band)", "fragile claims"],
                           "| --- | --- | --- | ---: | ---: | ---: | --- |", rows)
    return {"bars": table}


COLOURS = {"default": "#9e9e9e", "ours": "#1b7837", "rival": "#762a83"}
LEGEND = {"default": "transformers' default path (no kernelize)", "ours": "ours (kernelize)",
          "rival": "best tuned rival (named under the chip)"}
RIVAL_NAMES = {"megablox": "megablox", "vllm_gmm": "vLLM gmm", "vllm_fused_ep_moe": "vLLM fused MoE",
               "tokamax": "tokamax", "xla_ragged_dot": "XLA ragged_dot", "vLLM MLA v2": "vLLM MLA v2"}
BAR_WIDTH = 0.27
FRAGILE_COLOUR = "#d73027"


def _draw_point(ax, index: int, point: dict) -> None:
    """One chip's bars of a panel at x = `index`: default (with how many times ours it takes), ours, rival, each with
    its band's whisker; ours is hatched and the group labelled when a claim there is fragile."""
    by_path = {bar["path"]: bar for bar in point["bars"]}
    compared = max((bar["band_p90_us"] or [bar["us"]] * 2)[1] for bar in point["bars"] if bar["path"] != "default")
    for offset, path in zip((-BAR_WIDTH, 0.0, BAR_WIDTH), PATHS):
        bar, x = by_path.get(path), index + offset
        if bar is None:
            continue  # the panel's note says which chips a path is priced on
        if path == "default":
            ax.text(x, bar["us"] * 1.1, f"{bar['us'] / by_path['ours']['us']:.0f}x ours", ha="center", va="bottom",
                    fontsize=6.5)
        band = bar["band_p90_us"]
        error = [[bar["us"] - band[0]], [band[1] - bar["us"]]] if band else None
        fragile = path == "ours" and bool(point["fragile"])
        ax.bar(x, bar["us"], BAR_WIDTH, color=COLOURS[path], hatch="////" if fragile else None,
               edgecolor=FRAGILE_COLOUR if fragile else COLOURS[path], linewidth=0.8 if fragile else 0,
               yerr=error, capsize=2.5, error_kw={"linewidth": 0.9, "ecolor": "black"})
    if point["fragile"]:
        ax.text(index + BAR_WIDTH / 2, compared * 1.15, "fragile", ha="center", va="bottom", fontsize=7,
                color=FRAGILE_COLOUR, fontweight="bold")


def _unpriced_note(panel: dict) -> str:
    """Which chips of the panel's own each path is priced on, where that is not all of them."""
    chips = [point["generation"] for point in panel["points"]]
    notes = []
    for path in ("default", "rival"):
        priced = [point["generation"] for point in panel["points"] if any(b["path"] == path for b in point["bars"])]
        if priced != chips:
            where = f"priced on {', '.join(GENERATION_NAMES[g] for g in priced)} only" if priced else "not modelled"
            notes.append(f"{LEGEND[path].split(' (')[0]}: {where}")
    return "\n".join(notes)


def draw(panels: list[dict], path: Path, digest: str) -> None:
    """The picture: a panel per headline, a group of bars per chip on a log scale; `digest` goes into the PNG's
    metadata under `DIGEST_KEY`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    columns = 3
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(15, 4.4 * rows + 1.2), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        points = {point["generation"]: point for point in panel["points"]}
        lows = [(bar["band_p90_us"] or [bar["us"]])[0] for point in panel["points"] for bar in point["bars"]]
        highs = [(bar["band_p90_us"] or [bar["us"]] * 2)[1] for point in panel["points"] for bar in point["bars"]]
        ticks = []
        for index, generation in enumerate(GENERATIONS):
            rival = next((bar for bar in points[generation]["bars"] if bar["path"] == "rival"), None) \
                if generation in points else None
            ticks.append(GENERATION_NAMES[generation] + (f"\n{RIVAL_NAMES.get(rival['name'], rival['name'])}"
                                                         if rival else ""))
            if generation in points:
                _draw_point(ax, index, points[generation])
            else:
                ax.text(index, 0.03, "not modelled", transform=ax.get_xaxis_transform(), ha="center",
                        va="bottom", fontsize=7, color="#555555")
        ax.text(0.01, 0.98, _unpriced_note(panel), transform=ax.transAxes, ha="left", va="top", fontsize=7,
                color="#555555")
        ax.set_yscale("log")
        ax.set_ylim(min(lows) / 3, max(highs) * 6)
        ax.set_xticks(range(len(GENERATIONS)), ticks, fontsize=8)
        ax.set_title(f"{panel['model']}\n{KIND_TITLES[panel['kind']]}", fontsize=9)
        ax.set_ylabel("modelled µs per call (log scale)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    handles = [Patch(color=COLOURS[path], label=LEGEND[path]) for path in PATHS]
    handles += [Line2D([], [], color="black", marker="_", markersize=8, linewidth=0.9,
                       label="p90 calibrated band (none: no timing checks that kind of call)"),
                Patch(facecolor=COLOURS["ours"], hatch="////", edgecolor=FRAGILE_COLOUR,
                      label="fragile: a claim here flips over the constants no chip pins down")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Modelled device time per call, lower is better: a model of the compiled programs calibrated on "
                 "real-chip timings, not a measurement", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=100, metadata={DIGEST_KEY: digest, "Software": None})
    plt.close(fig)
