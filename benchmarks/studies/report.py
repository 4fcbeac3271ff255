"""The docs' figures, generated from what the benchmarks wrote: `python -m benchmarks report [--check]`.

A figure typed into a doc drifts from the benchmark that produced it. So the
tracked docs (`DOCS`) hold generated blocks instead:

    <!-- generated: benchmarks/results/moe_layer.md -->
    | shape | gen | ... |
    <!-- end generated -->

The opening marker names the source, a markdown file the benchmarks write in
`benchmarks/results/`; `benchmarks/results/NAME.md#SECTION` names the part of
it under the heading `## SECTION`, for a results file that holds several
tables. A block's body is the source's text, each line indented as the
opening marker is (a table inside a list item stays inside it).

Some tables exist only as JSON: `DERIVED_TABLES` renders their .md from the
benchmark's JSON, so no results .md is typed either: most through their
benchmark's `benchmarks.studies.tables.<benchmark>.render_markdown`, the MoE
layer's and backward's here.

Pictures (`PICTURES`) are drawn from the studies' JSON too; each PNG carries
the digest of what it drew in its metadata, so a stale picture is found by
that digest, never by its pixels.

`refresh` rewrites the derived tables, the stale pictures and every block from
its source; `problems` lists every block (or derived table, or picture) that
differs from its source, every marker whose source is missing, and every
figure typed into the docs' prose outside the blocks (`prose_figures`),
without writing anything.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.studies import calibration_bands, prose_figures
from benchmarks.studies.tables import attention as attention_tables
from benchmarks.studies.tables import binding as binding_tables
from benchmarks.studies.tables import calibration as calibration_tables
from benchmarks.studies.tables import cb_step as cb_step_tables
from benchmarks.studies.tables import compiles as compiles_tables
from benchmarks.studies.tables import decode_step as decode_step_tables
from benchmarks.studies.tables import fused_moe_search as fused_moe_search_tables
from benchmarks.studies.tables import held_out as held_out_tables
from benchmarks.studies.tables import hub_server as hub_server_tables
from benchmarks.studies.tables import int4_granularity as int4_granularity_tables
from benchmarks.studies.tables import loader as loader_tables
from benchmarks.studies.tables import moe_layer as moe_layer_tables
from benchmarks.studies.tables import multichip as multichip_tables
from benchmarks.studies.tables import mla as mla_tables
from benchmarks.studies.tables import paged_attention as paged_attention_tables
from benchmarks.studies.tables import padding as padding_tables
from benchmarks.studies.tables import quantization_accuracy as quantization_accuracy_tables
from benchmarks.studies.tables import rmsnorm as rmsnorm_tables
from benchmarks.studies.tables import robustness as robustness_tables
from benchmarks.studies.tables import speed as speed_figure
from benchmarks.perf.chip import CONSTANTS as MODEL_CONSTANTS

# The tracked docs that may hold generated blocks, as globs relative to the project's root: the study pages
# (`PAGES_DIR`) are docs, one per study, that the index benchmarks/README.md links.
PAGES_DIR = "benchmarks/results/pages"
DOCS = ("README.md", "docs/*.md", "benchmarks/README.md", f"{PAGES_DIR}/*.md", "kernel_repos/*/CARD.md")
# Sources live beside the benchmarks' JSON, directly in SOURCES_DIR: a block never includes another doc (a study
# page included) or any file outside the results.
SOURCES_DIR = "benchmarks/results"

OPENING = re.compile(r"^(?P<indent>[ \t]*)<!-- generated: (?P<source>\S+) -->[ \t]*$", re.MULTILINE)
CLOSING = re.compile(r"^[ \t]*<!-- end generated -->[ \t]*$", re.MULTILINE)
CLOSING_TEXT = "<!-- end generated -->"


class MissingSource(Exception):
    """A block's source (file, section, or a figure its JSON should hold) is not there: the message says what."""


@dataclass(frozen=True)
class Block:
    """One generated block of a doc: `start`..`end` spans the text from the opening marker to the closing one."""

    doc: str
    line: int
    source: str
    indent: str
    start: int
    end: int


def find_blocks(doc: str, text: str) -> tuple[list[Block], list[str]]:
    """The generated blocks of `text` (doc `doc`), and the markers that open no well-formed block."""
    blocks, malformed = [], []
    position = 0
    while (opening := OPENING.search(text, position)) is not None:
        line = text.count("\n", 0, opening.start()) + 1
        closing = CLOSING.search(text, opening.end())
        following = OPENING.search(text, opening.end())
        if closing is None or (following is not None and following.start() < closing.start()):
            malformed.append(f"{doc}:{line}: block from {opening['source']} has no `{CLOSING_TEXT}` "
                             "before the next block")
            position = opening.end()
            continue
        blocks.append(Block(doc, line, opening["source"], opening["indent"], opening.start(), closing.end()))
        position = closing.end()
    return blocks, malformed


def section(text: str, name: str, source: str) -> str:
    """The part of `text` under its heading `## name`, up to the next `## ` heading."""
    lines = text.splitlines()
    try:
        first = lines.index(f"## {name}") + 1
    except ValueError:
        raise MissingSource(f"{source} has no section `## {name}`") from None
    last = next((i for i in range(first, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[first:last])


def block_text(block: Block, body: str) -> str:
    """The block as it should read: opening marker, the body indented as the marker, closing marker."""
    lines = [block.indent + line if line.strip() else "" for line in body.strip("\n").splitlines()]
    opening = f"{block.indent}<!-- generated: {block.source} -->"
    return "\n".join([opening, *lines, block.indent + CLOSING_TEXT])


def doc_paths(root: Path) -> list[Path]:
    """The tracked docs under `root` that may hold generated blocks, in a stable order."""
    found = {path for pattern in DOCS for path in root.glob(pattern) if path.is_file()}
    return sorted(found)


class Sources:
    """Reads blocks' sources under `root`; a derived table reads as its fresh rendering, not as the file on disk."""

    def __init__(self, root: Path):
        self.root = root
        self.rendered: dict[str, str] = {}
        self.unrenderable: dict[str, str] = {}
        for path, render in DERIVED_TABLES.items():
            try:
                self.rendered[path] = render(root)
            except (OSError, MissingSource, KeyError, ValueError) as error:
                self.unrenderable[path] = f"{path} cannot be rendered from its JSON: {error}"

    def body(self, source: str) -> str:
        path, _, name = source.partition("#")
        if Path(path).parent.as_posix() != SOURCES_DIR or not path.endswith(".md"):
            raise MissingSource(f"{source} is not a markdown file in {SOURCES_DIR}/")
        if path in self.unrenderable:
            raise MissingSource(self.unrenderable[path])
        if path in self.rendered:
            text = self.rendered[path]
        elif (self.root / path).is_file():
            text = (self.root / path).read_text()
        else:
            raise MissingSource(f"{path} does not exist")
        return section(text, name, source) if name else text


def stale_derived_tables(sources: Sources) -> list[str]:
    """Derived tables on disk that differ from their rendering (or cannot be rendered)."""
    stale = list(sources.unrenderable.values())
    for path, text in sources.rendered.items():
        on_disk = sources.root / path
        if not on_disk.is_file() or on_disk.read_text() != text:
            stale.append(f"{path} differs from its rendering from the benchmark's JSON")
    return stale


def updated_docs(sources: Sources) -> tuple[dict[Path, str], list[str], list[str]]:
    """Every doc whose blocks would change, with its new text; the blocks that differ; those that cannot be read."""
    changed, differing, unreadable = {}, [], []
    for path in doc_paths(sources.root):
        doc = path.relative_to(sources.root).as_posix()
        text = path.read_text()
        blocks, malformed = find_blocks(doc, text)
        unreadable += malformed
        pieces, position = [], 0
        for block in blocks:
            current = text[block.start:block.end]
            try:
                wanted = block_text(block, sources.body(block.source))
            except MissingSource as error:
                unreadable.append(f"{doc}:{block.line}: missing source: {error}")
                wanted = current  # left as it is: nothing to rewrite it from
            if wanted != current:
                differing.append(f"{doc}:{block.line}: block differs from its source {block.source}")
            pieces += [text[position:block.start], wanted]
            position = block.end
        new_text = "".join(pieces) + text[position:]
        if new_text != text:
            changed[path] = new_text
    return changed, differing, unreadable


def typed_figures(root: Path) -> list[str]:
    """The figures typed into the docs' prose (outside their generated blocks) that are not allowed facts."""
    docs = []
    for path in doc_paths(root):
        doc, text = path.relative_to(root).as_posix(), path.read_text()
        blocks, _ = find_blocks(doc, text)
        docs.append(prose_figures.Doc(doc, text, tuple((block.start, block.end) for block in blocks)))
    return prose_figures.problems(root, docs)


# A modelled time below its roofline is a model or accounting error (the roofline is the least time the work
# can take at the chip's peaks), so no share of one may exceed 100 %; the rounding slack is for figures the
# benchmarks round.
ROOFLINE_SHARE = re.compile(r"pct_of_(\w*_)?roofline")
ROOFLINE_SHARE_SLACK_PCT = 0.05


def impossible_roofline_shares(root: Path) -> list[str]:
    """Every share of a roofline above 100 % in benchmarks/results/*.json, as file:path = value."""
    found = []

    def walk(value, path: str, name: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if (ROOFLINE_SHARE.fullmatch(key) and isinstance(item, (int, float)) and not isinstance(item, bool)
                        and item > 100.0 + ROOFLINE_SHARE_SLACK_PCT):
                    found.append(f"{name}:{path}/{key} = {item:.1f} % of a roofline (a time below its roofline)")
                else:
                    walk(item, f"{path}/{key}", name)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(item, f"{path}[{index}]", name)

    for path in sorted((root / "benchmarks" / "results").glob("*.json")):
        walk(json.loads(path.read_text()), "", path.relative_to(root).as_posix())
    return found


def stale_pictures(root: Path) -> tuple[dict[str, tuple], list[str]]:
    """The pictures (`PICTURES`) not drawn from the current JSON, each with what to draw it from (its figures and
    their digest); and those that cannot be drawn. A picture is checked by the digest its metadata carries, never by
    its pixels."""
    stale, undrawable = {}, []
    for path, picture in PICTURES.items():
        try:
            figures = picture.bars(root)
        except (OSError, KeyError, ValueError) as error:
            undrawable.append(f"{path} cannot be drawn from its JSON: {error}")
            continue
        digest = picture.inputs_digest(figures)
        if picture.stored_digest(root / path) != digest:
            stale[path] = (figures, digest)
    return stale, undrawable


def problems(root: Path) -> list[str]:
    """Everything `--check` reports: stale derived tables and pictures, blocks that differ from their source, missing
    sources, figures typed into prose, shares of a roofline above 100 %."""
    sources = Sources(root)
    _, differing, unreadable = updated_docs(sources)
    stale, undrawable = stale_pictures(root)
    pictures = [f"{path} was not drawn from the current JSON (the digest in its metadata differs)" for path in stale]
    return (stale_derived_tables(sources) + pictures + undrawable + differing + unreadable + typed_figures(root)
            + impossible_roofline_shares(root))


def refresh(root: Path) -> tuple[list[Path], list[str]]:
    """Writes the derived tables, every stale picture and every block from its source; the files written and what
    could not be read."""
    sources = Sources(root)
    written = []
    for path, text in sources.rendered.items():
        target = root / path
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)
            written.append(target)
    stale, undrawable = stale_pictures(root)
    for path, (figures, digest) in stale.items():
        PICTURES[path].draw(figures, root / path, digest)
        written.append(root / path)
    changed, _, unreadable = updated_docs(sources)
    for path, text in changed.items():
        path.write_text(text)
    return written + list(changed), list(sources.unrenderable.values()) + undrawable + unreadable


# --- Tables rendered from JSON (their benchmark writes no markdown for them) ---------------------------------------

# moe_layer's settings as the ragged-dot card names them.
QWEN3_EP8_256 = ("qwen3-30b-a3b EP8 router-masking T=256", "Qwen3-30B-A3B, EP8 rank, 256 tokens")
QWEN3_ONE_CHIP_1 = ("qwen3-30b-a3b T=1", "Qwen3-30B-A3B, one chip, 1 token")
GPT_OSS_EP8_64 = ("gpt-oss-20b EP8 dispatch T=64", "GPT-OSS-20B, EP8 rank, 64 tokens")
DEEPSEEK_EP32_256 = ("deepseek-v3 EP32 dispatch T=256", "DeepSeek-V3, EP32 rank, 256 tokens")
# The weights' formats, as moe_layer names its variants.
FORMATS = {"bf16": "ours", "int8": "ours_int8", "fp8": "ours_fp8", "int4": "ours_int4"}
# v5e and v6e come from moe_layer's default run, v5p and TPU7x from its `--generations v5p tpu7x` run.
MOE_LAYER_RUNS = ("moe_layer.json", "moe_layer_v5p_tpu7x.json")


def moe_layer_variants(root: Path) -> dict[tuple[str, str, str], dict]:
    """moe_layer's variant lines from its runs, by (generation, setting label, variant)."""
    lines = {}
    for name in MOE_LAYER_RUNS:
        data = json.loads((root / SOURCES_DIR / name).read_text())
        lines.update({(line["generation"], line["label"], line["variant"]): line for line in data["variants"]})
    return lines


def moe_layer_formats(root: Path) -> str:
    """benchmarks/results/moe_layer_formats.md: our experts layer per weights format, from moe_layer's JSON."""
    lines = moe_layer_variants(root)

    def line(generation: str, label: str, variant: str) -> dict:
        try:
            return lines[generation, label, variant]
        except KeyError:
            runs = ", ".join(MOE_LAYER_RUNS)
            raise MissingSource(f"no {variant} line for {label} on {generation} in {runs}") from None

    decode = ["| one experts layer, decode, v6e | bf16 | int8 | fp8 | int4 |", "| --- | ---: | ---: | ---: | ---: |"]
    for label, name in (QWEN3_EP8_256, QWEN3_ONE_CHIP_1, GPT_OSS_EP8_64):
        cells = [line("v6e", label, variant) for variant in FORMATS.values()]
        figures = (f"{cell['hbm_bytes'] / 1e6:.1f} MB, {cell['us']:.1f} µs" for cell in cells)
        decode.append(f"| {name} | " + " | ".join(figures) + " |")

    chips = {"v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "tpu7x": "TPU7x"}
    per_chip = ["| shape | " + " | ".join(chips.values()) + " |", "| --- |" + " --- |" * len(chips)]
    for label, name in (QWEN3_ONE_CHIP_1, QWEN3_EP8_256, GPT_OSS_EP8_64, DEEPSEEK_EP32_256):
        cells = [" / ".join(f"{line(generation, label, FORMATS[f])['us']:.1f}" for f in ("bf16", "int8", "fp8"))
                 for generation in chips]
        per_chip.append(f"| {name} | " + " | ".join(cells) + " |")

    return "\n".join([
        f"<!-- written by `python -m benchmarks report` from {' and '.join(MOE_LAYER_RUNS)}: do not edit -->",
        "", "## decode-v6e", "", *decode,
        "", "## per-chip", "", *per_chip, "",
    ])


# moe_backward's kernels as the card names them: d_rhs is the transposed grouped matmul, tgmm.
BACKWARD_KERNELS = {"d_lhs": "d_lhs", "d_rhs": "tgmm"}
BACKWARD_GENERATIONS = ("v5e", "v6e")


def moe_backward_tables(root: Path) -> str:
    """benchmarks/results/moe_backward.md: each backward kernel, and the layer's backward over its forward."""
    data = json.loads((root / SOURCES_DIR / "moe_backward.json").read_text())

    def with_pct(figures: dict) -> str:
        return f"{figures['modelled_time_us']:.0f} ({figures['pct_of_roofline']:.1f})"

    kernels = ["| layer, projection | kernel | gen | ours µs (p90 band) | ours % roofline | ours %, copies overlapped "
               "| megablox µs (%) | tokamax µs (%) |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for entry in data["entries"]:
        for kernel, name in BACKWARD_KERNELS.items():
            for generation in BACKWARD_GENERATIONS:
                ours, megablox, tokamax = (entry["kernels"][kernel][variant][generation]
                                           for variant in ("ours", "megablox", "tokamax"))
                kernels.append(f"| {entry['setting']} {entry['projection']} | {name} | {generation} "
                               f"| {ours['modelled_time_us']:.0f} ({calibration_bands.span(ours['band_p90_us'])}) "
                               f"| {ours['pct_of_roofline']:.1f} | {ours['overlap_pct_of_roofline']:.1f} "
                               f"| {with_pct(megablox)} | {with_pct(tokamax)} |")

    return "\n".join([
        "<!-- written by `python -m benchmarks report` from moe_backward.json: do not edit -->",
        "", "## kernels", "", *kernels, "", "## layer", "", *backward_layer_table(data["layer_ratios"]), "",
    ])


def backward_layer_table(ratios: list[dict]) -> list[str]:
    """moe_backward's `layer_ratios` as Markdown table lines: each layer's backward over its forward, and the rivals'
    backward (the study prints it too)."""
    layer = ["| layer | gen | forward µs | backward µs | ratio | megablox backward µs | tokamax backward µs |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for ratio in ratios:
        layer.append(f"| {ratio['setting']} | {ratio['generation']} | {ratio['forward_us']:.0f} "
                     f"| {ratio['ours_backward_us']:.0f} | {ratio['ours_backward_over_our_forward']:.2f} "
                     f"| {ratio['megablox_backward_us']:.0f} | {ratio['tokamax_backward_us']:.0f} |")
    return layer


# Calibration reports of chips whose timings check the model without standing for a generation's bands: v5p's and
# v6e's timings from a later tokamax (benchmarks/results/pages/calibration.md says how they are written).
CALIBRATION_CHECKS = ("calibration_v5p.json", "calibration_v6e.json")


def calibration_tables_md(root: Path) -> str:
    """benchmarks/results/calibration.md: the model's error per chip and kind, and the constants it prices with."""
    report_json = json.loads((root / SOURCES_DIR / "calibration.json").read_text())
    checks = tuple(json.loads((root / SOURCES_DIR / name).read_text()) for name in CALIBRATION_CHECKS)
    lines = [f"<!-- written by `python -m benchmarks report` from calibration.json, {', '.join(CALIBRATION_CHECKS)} and "
             "the performance model's constants (benchmarks/perf/model_constants.json, hbm_fractions.json): do not "
             "edit -->"]
    hbm_fractions = json.loads(resources.files("benchmarks.perf").joinpath("hbm_fractions.json").read_text())
    for name, table in calibration_tables.render_markdown(report_json, MODEL_CONSTANTS, hbm_fractions,
                                                          checks).items():
        lines += ["", f"## {name}", "", table]
    return "\n".join(lines) + "\n"


def sectioned_tables(json_name: str, render_markdown: Callable[[dict], dict[str, str]]) -> Callable[[Path], str]:
    """A derived table's renderer from a benchmark's `render_markdown(json) -> {section: table}`."""

    def render(root: Path) -> str:
        sections = render_markdown(json.loads((root / SOURCES_DIR / json_name).read_text()))
        lines = [f"<!-- written by `python -m benchmarks report` from {json_name}: do not edit -->"]
        for name, table in sections.items():
            lines += ["", f"## {name}", "", table.strip("\n")]
        return "\n".join(lines) + "\n"

    return render


def speed_tables(root: Path) -> str:
    """benchmarks/results/speed.md: the figures the README's speed picture draws."""
    inputs = ", ".join([*speed_figure.MOE_LAYER_RUNS, "decode_step.json", "mla.json", "robustness.json"])
    lines = [f"<!-- written by `python -m benchmarks report` from {inputs}: do not edit -->"]
    for name, table in speed_figure.render_markdown(speed_figure.bars(root)).items():
        lines += ["", f"## {name}", "", table]
    return "\n".join(lines) + "\n"


# The pictures drawn from the studies' JSON (relative to the root) -> their module: `bars(root)` gathers the
# figures, `inputs_digest(figures)` is what the PNG's metadata carries (`stored_digest(path)` reads it back),
# `draw(figures, path, digest)` draws it.
PICTURES = {f"{SOURCES_DIR}/speed.png": speed_figure}

# results .md (relative to the root) -> its renderer from the benchmark's JSON.
DERIVED_TABLES: dict[str, Callable[[Path], str]] = {
    f"{SOURCES_DIR}/moe_layer_formats.md": moe_layer_formats,
    f"{SOURCES_DIR}/moe_backward.md": moe_backward_tables,
    f"{SOURCES_DIR}/calibration.md": calibration_tables_md,
    f"{SOURCES_DIR}/binding.md": sectioned_tables("binding.json", binding_tables.render_markdown),
    f"{SOURCES_DIR}/attention.md": sectioned_tables("attention.json", attention_tables.render_markdown),
    f"{SOURCES_DIR}/multichip.md": sectioned_tables("multichip.json", multichip_tables.render_markdown),
    f"{SOURCES_DIR}/fused_moe_search.md": sectioned_tables("fused_moe_search.json",
                                                           fused_moe_search_tables.render_markdown),
    f"{SOURCES_DIR}/decode_step.md": sectioned_tables("decode_step.json", decode_step_tables.render_markdown),
    f"{SOURCES_DIR}/paged_attention.md": sectioned_tables("paged_attention.json",
                                                          paged_attention_tables.render_markdown),
    f"{SOURCES_DIR}/cb_step.md": sectioned_tables("cb_step.json", cb_step_tables.render_markdown),
    f"{SOURCES_DIR}/mla.md": sectioned_tables("mla.json", mla_tables.render_markdown),
    # moe_layer writes its own moe_layer.md, moe_layer_v5p_tpu7x.md and moe_layer_v5p.md (the full tables): these
    # are the headlines.
    f"{SOURCES_DIR}/moe_layer_headline.md": sectioned_tables("moe_layer.json", moe_layer_tables.render_markdown),
    f"{SOURCES_DIR}/moe_layer_v5p_tpu7x_headline.md": sectioned_tables(
        "moe_layer_v5p_tpu7x.json", moe_layer_tables.render_v5p_tpu7x_markdown),
    f"{SOURCES_DIR}/moe_layer_v5p_headline.md": sectioned_tables("moe_layer_v5p.json",
                                                                 moe_layer_tables.render_v5p_markdown),
    f"{SOURCES_DIR}/loader.md": sectioned_tables("loader.json", loader_tables.render_markdown),
    f"{SOURCES_DIR}/hub_server.md": sectioned_tables("hub_server.json", hub_server_tables.render_markdown),
    f"{SOURCES_DIR}/rmsnorm.md": sectioned_tables("rmsnorm.json", rmsnorm_tables.render_markdown),
    f"{SOURCES_DIR}/robustness.md": sectioned_tables("robustness.json", robustness_tables.render_markdown),
    f"{SOURCES_DIR}/held_out.md": sectioned_tables("held_out.json", held_out_tables.render_markdown),
    f"{SOURCES_DIR}/quantization_accuracy.md": sectioned_tables("quantization_accuracy.json",
                                                                quantization_accuracy_tables.render_markdown),
    f"{SOURCES_DIR}/quantization_accuracy_tpu7x.md": sectioned_tables("quantization_accuracy_tpu7x.json",
                                                                      quantization_accuracy_tables.render_markdown),
    f"{SOURCES_DIR}/int4_granularity.md": sectioned_tables("int4_granularity.json",
                                                           int4_granularity_tables.render_markdown),
    f"{SOURCES_DIR}/compiles.md": sectioned_tables("compiles.json", compiles_tables.render_markdown),
    f"{SOURCES_DIR}/padding.md": sectioned_tables("padding.json", padding_tables.render_markdown),
    f"{SOURCES_DIR}/speed.md": speed_tables,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Rewrite the docs' generated blocks from benchmarks/results/.")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 listing every block that differs from its source or lacks one, "
                             "every picture not drawn from the current JSON, every figure typed into the docs' "
                             "prose and every share of a roofline above 100 %%")
    parser.add_argument("--root", type=Path, default=Path("."), help="the tpu-kernels checkout (default: here)")
    args = parser.parse_args(argv)
    if args.check:
        found = problems(args.root)
        for problem in found:
            print(problem, file=sys.stderr)
        print(f"{len(found)} problem(s): generated blocks or tables out of date, or figures typed in prose" if found
              else "generated blocks up to date, no figure typed in prose")
        return 1 if found else 0
    written, unreadable = refresh(args.root)
    for path in written:
        print(f"wrote {path}")
    for problem in unreadable:
        print(problem, file=sys.stderr)
    return 1 if unreadable else 0


if __name__ == "__main__":
    sys.exit(main())
