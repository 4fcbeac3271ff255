"""`python -m benchmarks report`: the docs' generated blocks come from benchmarks/results/, never retyped."""

import json
import shutil
from pathlib import Path

import pytest

from benchmarks import cli
from benchmarks.studies import prose_figures, report
from benchmarks.studies.tables import attention as attention_tables
from benchmarks.studies.tables import binding as binding_tables
from benchmarks.studies.tables import calibration as calibration_tables
from benchmarks.studies.tables import hub_server as hub_server_tables
from benchmarks.studies.tables import int4_granularity as int4_granularity_tables
from benchmarks.studies.tables import loader as loader_tables
from benchmarks.studies.tables import moe_layer as moe_layer_tables
from benchmarks.studies.tables import multichip as multichip_tables
from benchmarks.studies.tables import quantization_accuracy as quantization_accuracy_tables
from benchmarks.studies.tables import rmsnorm as rmsnorm_tables

ROOT = Path(__file__).resolve().parents[1]

TABLE = "| shape | us |\n| --- | ---: |\n| a | 1.0 |\n"
SECTIONED = "## first\n\n| x |\n| --- |\n| 1 |\n\n## second\n\n| y |\n| --- |\n| 2 |\n"


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A checkout with one results table, one sectioned results file, and no derived tables to render."""
    monkeypatch.setattr(report, "DERIVED_TABLES", {})
    monkeypatch.setattr(report, "PICTURES", {})
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "layer.md").write_text(TABLE)
    (results / "two.md").write_text(SECTIONED)
    return tmp_path


def write_doc(root: Path, text: str) -> Path:
    path = root / "README.md"
    path.write_text(text)
    return path


def test_a_block_is_rewritten_from_its_source_indented_as_its_marker(checkout):
    doc = write_doc(checkout, "intro\n\n- item:\n\n  <!-- generated: benchmarks/results/layer.md -->\n"
                              "  | shape | us |\n  | a | 9.9 |\n  <!-- end generated -->\n\nafter\n")
    assert report.problems(checkout) == ["README.md:5: block differs from its source benchmarks/results/layer.md"]
    written, unreadable = report.refresh(checkout)
    assert written == [doc] and unreadable == []
    assert doc.read_text() == ("intro\n\n- item:\n\n  <!-- generated: benchmarks/results/layer.md -->\n"
                               "  | shape | us |\n  | --- | ---: |\n  | a | 1.0 |\n  <!-- end generated -->\n\nafter\n")
    assert report.problems(checkout) == []


def test_a_block_names_one_section_of_a_results_file(checkout):
    doc = write_doc(checkout, "<!-- generated: benchmarks/results/two.md#second -->\n<!-- end generated -->\n")
    report.refresh(checkout)
    assert doc.read_text() == ("<!-- generated: benchmarks/results/two.md#second -->\n| y |\n| --- |\n| 2 |\n"
                               "<!-- end generated -->\n")


def test_check_fails_on_a_changed_block(checkout, capsys):
    write_doc(checkout, f"<!-- generated: benchmarks/results/layer.md -->\n{TABLE}<!-- end generated -->\n")
    assert report.main(["--check", "--root", str(checkout)]) == 0
    (checkout / "benchmarks" / "results" / "layer.md").write_text(TABLE.replace("1.0", "1.1"))
    assert report.main(["--check", "--root", str(checkout)]) == 1
    assert "README.md:1: block differs from its source benchmarks/results/layer.md" in capsys.readouterr().err


def test_check_fails_on_a_share_of_a_roofline_above_100_pct(checkout, capsys):
    results = checkout / "benchmarks" / "results"
    (results / "kernel.json").write_text(json.dumps(
        {"rows": [{"pct_of_roofline": 99.99, "pct_of_hbm_roofline_peak": 100.02, "over_roofline": 0.5},
                  {"per_generation": {"v5e": {"pct_of_roofline": 199.4}}}]}))
    assert report.main(["--check", "--root", str(checkout)]) == 1
    err = capsys.readouterr().err
    assert "benchmarks/results/kernel.json:/rows[1]/per_generation/v5e/pct_of_roofline = 199.4 %" in err
    assert err.count("of a roofline") == 1  # within the rounding slack; a ratio that is not a share is not checked


def test_check_lists_every_missing_source(checkout, capsys):
    cards = checkout / "kernel_repos" / "some-tpu"
    cards.mkdir(parents=True)
    (cards / "CARD.md").write_text("<!-- generated: benchmarks/results/gone.md -->\nold\n<!-- end generated -->\n"
                                   "<!-- generated: benchmarks/results/two.md#third -->\n<!-- end generated -->\n"
                                   "<!-- generated: docs/other.md -->\n<!-- end generated -->\n"
                                   "<!-- generated: benchmarks/results/pages/study.md -->\n<!-- end generated -->\n")
    write_doc(checkout, "<!-- generated: benchmarks/results/layer.md -->\nno end marker\n")
    before = (cards / "CARD.md").read_text()
    assert report.main(["--check", "--root", str(checkout)]) == 1
    err = capsys.readouterr().err
    assert "CARD.md:1: missing source: benchmarks/results/gone.md does not exist" in err
    assert "CARD.md:4: missing source: benchmarks/results/two.md#third has no section `## third`" in err
    assert "CARD.md:6: missing source: docs/other.md is not a markdown file in benchmarks/results/" in err
    # A study page is a doc, never a source.
    assert ("CARD.md:8: missing source: benchmarks/results/pages/study.md is not a markdown file in "
            "benchmarks/results/") in err
    assert "README.md:1: block from benchmarks/results/layer.md has no `<!-- end generated -->`" in err
    # Without --check it still says so, and leaves blocks it cannot fill as they were.
    assert report.main(["--root", str(checkout)]) == 1
    assert (cards / "CARD.md").read_text() == before


def test_a_derived_table_is_rendered_from_its_json_and_checked_against_it(checkout, monkeypatch):
    figures = checkout / "benchmarks" / "results" / "figures.json"
    figures.write_text('{"us": 2.0}')

    def render(root: Path) -> str:
        import json

        return f"| us |\n| --- |\n| {json.loads((root / 'benchmarks/results/figures.json').read_text())['us']} |\n"

    monkeypatch.setattr(report, "DERIVED_TABLES", {"benchmarks/results/figures.md": render})
    write_doc(checkout, "<!-- generated: benchmarks/results/figures.md -->\n<!-- end generated -->\n")
    stale = "benchmarks/results/figures.md differs from its rendering from the benchmark's JSON"
    assert stale in report.problems(checkout)
    report.refresh(checkout)
    assert (checkout / "benchmarks" / "results" / "figures.md").read_text() == "| us |\n| --- |\n| 2.0 |\n"
    assert report.problems(checkout) == []
    figures.write_text('{"us": 3.0}')  # the benchmark ran again: the .md on disk and the block are both stale
    assert len(report.problems(checkout)) == 2


def test_the_repos_tracked_docs_match_their_sources():
    """What keeps the docs honest: every committed block equals what the benchmarks' results render."""
    assert report.problems(ROOT) == []


def test_the_ragged_dot_card_takes_its_tables_from_moe_layer_moe_backward_and_robustness():
    card = (ROOT / "kernel_repos" / "ragged-dot-tpu" / "CARD.md").read_text()
    blocks, _ = report.find_blocks("CARD.md", card)
    assert {block.source for block in blocks} >= {"benchmarks/results/moe_layer_formats.md#decode-v6e",
                                                  "benchmarks/results/moe_layer_formats.md#per-chip",
                                                  "benchmarks/results/moe_backward.md#kernels",
                                                  "benchmarks/results/moe_backward.md#layer",
                                                  "benchmarks/results/robustness.md#backward"}


def test_a_benchmarks_sections_make_one_derived_table(checkout, monkeypatch):
    (checkout / "benchmarks" / "results" / "figures.json").write_text('{"us": 2.0}')
    def render_markdown(data: dict) -> dict[str, str]:
        return {"one": f"| us |\n| {data['us']} |\n", "two": "| x |"}

    render = report.sectioned_tables("figures.json", render_markdown)
    monkeypatch.setattr(report, "DERIVED_TABLES", {"benchmarks/results/figures.md": render})
    assert render(checkout) == ("<!-- written by `python -m benchmarks report` from figures.json: do not edit -->\n\n"
                                "## one\n\n| us |\n| 2.0 |\n\n## two\n\n| x |\n")
    doc = write_doc(checkout, "<!-- generated: benchmarks/results/figures.md#two -->\n<!-- end generated -->\n")
    report.refresh(checkout)
    assert doc.read_text() == "<!-- generated: benchmarks/results/figures.md#two -->\n| x |\n<!-- end generated -->\n"


def test_binding_cost_per_call_table_from_its_json():
    part = {"part": "torch_tpu's normalisation", "us": 2.46, "also_on_tpu_path": True}
    cpu = {"per_call_us": {"bare_jit": {"min_us": 15.77}, "op": {"min_us": 124.26}}, "target_us": 100.0,
           "stretch_target_us": 50.0, "overhead_us": 108.49, "breakdown_unaccounted_us": 47.4,
           "breakdown_us": [part, {"part": "result -> torch", "us": 4.61, "also_on_tpu_path": False}],
           "race_detection_extra_us": 0.62}
    step = {"assumptions": "48 layers", "kernel_calls_per_step": 192, "host_ms_per_step_lower_bound": 8.137,
            "hf_step_ms_batch_1": 26.5, "share_of_hf_step": 0.307}
    tpu = {"per_call_us": {"add": {"min_us": 5.31}, "gated_experts": {"min_us": 8.96}},
           "per_call_us_through_jax_op": {"add": {"min_us": 19.21}, "gated_experts": {"min_us": 57.61}},
           "decode_step_model": step}
    tables = binding_tables.render_markdown({"cpu_path": cpu, "load_average_at_start": [0.95, 1.8], "cpu_count": 2,
                                             "tpu_path_python": tpu})
    assert tables["tpu-path"].splitlines() == [
        "| host Python per call on TPU tensors (launch stubbed out), minimum | µs | through `jax_op`, µs |",
        "| --- | ---: | ---: |", "| `add` | 5.3 | 19.2 |", "| `gated_experts` | 9.0 | 57.6 |", "",
        "| decode step, eager | |", "| --- | ---: |",
        "| kernel calls (48 layers) | 192 |", "| host Python, lower bound, ms | 8.1 |",
        "| Hugging Face's measured step at batch 1, ms | 26.5 |", "| share of that step | 31 % |"]
    assert tables["cost-per-call"] == "\n".join([
        "| per call, CPU, minimum over rounds (load average 0.9 on 2 cores) | µs | also on the TPU path |",
        "| --- | ---: | --- |",
        "| bare jitted call (JAX arrays, interpret mode) | 15.8 | |",
        "| **op through the binding** | **124.3** | |",
        "| **overhead** (target ≤ 100, stretch ≤ 50) | **108.5** | |",
        "| torch\\_tpu's normalisation | 2.5 | yes |",
        "| result -> torch | 4.6 | no |",
        "| unaccounted (noise, call glue) | 47.4 | |",
        "| with race detection on (our tests): watching standard output | 0.6 | no |",
    ])


def test_attention_forward_and_backward_tables_from_its_json(monkeypatch):
    monkeypatch.setattr(attention_tables, "FORWARD_SHAPES", {"decode B=8": "decode B=8", "prefill": "prefill S=8"})
    monkeypatch.setattr(attention_tables, "BACKWARD_SETTINGS", {"gpt-oss": "GPT-OSS-20B"})
    monkeypatch.setattr(attention_tables, "PER_GENERATION_SHAPES", {"decode B=8": "decode B=8"})
    monkeypatch.setattr(attention_tables, "GENERATIONS", ("v5e", "v6e"))

    def forward(bytes_ratio: float, us: float, bound: str) -> dict:
        return {"bytes_ratio": bytes_ratio, "band_p90_us": [0.8 * us, 1.2 * us], "modelled_time_us": us,
                "pct_of_roofline": 93.4, "bound": bound}

    def kernel(block: int, heads: int, us: float, pct: float, padding_efficiency: float = 0.5,
               computed_flops: float = 2.0) -> dict:
        return {"block_q": block, "block_kv": block, "kv_heads_per_step": heads, "modelled_pipelined_time_us": us,
                "pipelined_pct_of_roofline": pct, "mxu_padding_efficiency": padding_efficiency,
                "block_flops": computed_flops, "necessary_flops": 1.0}

    def backward(dq: dict, dkv: dict, ratio: float) -> dict:
        return {"kernels": {"dq": dq, "dkv": dkv}, "backward_over_forward": ratio}

    results = [{"label": "prefill", "per_generation": {"v5e": forward(1.3816, 573, "compute"),
                                                       "v6e": forward(1.3964, 573, "compute")}},
               {"label": "decode B=8", "per_generation": {"v5e": forward(1.0, 88, "hbm"),
                                                          "v6e": forward(1.0, 44, "hbm")}}]
    gpt_oss = {"label": "gpt-oss", "q_heads": 64, "kv_heads": 8, "head_dim": 64, "per_generation": {
        "v5e": backward(kernel(128, 8, 4853.5, 86.3), kernel(128, 8, 739.0, 28.4), 1.0),
        "v6e": backward(kernel(256, 4, 489.4, 27.7, 0.25, 3.968), kernel(256, 8, 613.3, 17.1, 0.25, 3.9), 0.87)}}
    tables = attention_tables.render_markdown({"results": results, "backward": {
        "results": [gpt_oss], "summary": {"target_pct_of_roofline_per_kernel": 80.0}}})
    assert tables["forward"] == "\n".join([
        "| shape | HBM bytes / minimum (v5e, v6e) | modelled v6e time (p90 band) |", "|---|---|---|",
        "| decode B=8 | 1.000, 1.000 | 44 µs (35–53; 93% of the HBM roofline) |",
        "| prefill S=8 | 1.382, 1.396 | 573 µs (458–688; compute-bound) |"])
    assert tables["backward"] == "\n".join([
        "| shape | gen | tiles (q, kv, KV heads/step) | dq | dk/dv | backward / forward |", "|---|---|---|---|---|---|",
        "| GPT-OSS-20B (64/8 heads, D=64) | v5e | 128, 128, 8 | 4854 µs, **86 %** | 739 µs, 28 % | 1.0x |",
        "| | v6e | 256, 256, 4 (dq) / 256, 256, 8 (dk/dv) | 489 µs, 28 % | 613 µs, 17 % | 0.9x |"])
    assert tables["backward-mxu-work"] == "\n".join([
        "| shape | gen | MXU work on padding | computed / visible pairs |", "|---|---|---|---|",
        "| GPT-OSS-20B | v5e | 50 % | 2.00x |",
        "| | v6e | 75 % | 3.97x (dq) / 3.90x (dk/dv) |"])
    with pytest.raises(KeyError, match="no result labelled prefill"):
        attention_tables.render_markdown({"results": results[1:], "backward": {}})


def test_attention_per_generation_table_names_the_bound(monkeypatch):
    monkeypatch.setattr(attention_tables, "PER_GENERATION_SHAPES", {"decode B=8": "decode B=8"})
    monkeypatch.setattr(attention_tables, "GENERATIONS", ("v5e", "tpu7x"))
    per_generation = {"v5e": {"modelled_time_us": 88.4, "pct_of_roofline": 93.2, "bound": "hbm"},
                      "tpu7x": {"modelled_time_us": 506.0, "pct_of_roofline": 24.4, "bound": "compute"}}
    table = attention_tables.per_generation([{"label": "decode B=8", "per_generation": per_generation}])
    assert table.splitlines()[2] == "| decode B=8 | 88 µs (93 % of the HBM roofline) | 506 µs (24 % of the MXU roofline) |"


def test_multichip_step_tables_from_its_json():
    def entry(mode: str, batch: int, central: float) -> dict:
        step_ms = {"central": central, "low": central / 2, "high": 2 * central}
        return {"mode": mode, "batch": batch, "per_step_ms": step_ms,
                "experts_layer_us": {"central": 10 * central}, "collectives_us_per_layer": {"central": central}}

    entries = [entry(mode, batch, ms) for mode, batch, ms in (
        ("tp", 8, 3.296), ("ep_router", 8, 3.157), ("ep_dispatch", 8, 5.0),
        ("tp", 1, 1.186), ("ep_router", 1, 1.961), ("ep_dispatch", 1, 3.817))]
    winners = {"1": {"mode": "tp"}, "8": {"mode": "ep_router"}}
    method = {"formulas": {"all-reduce": "2 (N-1)/N S / (2 W)"}, "host_sync_us": {"central": 30.0, "low": 10.0, "high": 100.0},
              "ici": {"diameter_hops": 4, "hop_latency_us": {"central": 1.0, "low": 0.5, "high": 2.0},
                      "link_bytes_per_s_one_way": 1e11, "mesh": {"rows": 2, "cols": 4}, "sources": "the book"},
              "left_out": "attention"}
    layer = {"layer_us": 50.0, "collectives_us": {"central": 12.0},
             "per_layer_us": {"low": 55.0, "central": 62.0, "high": 80.0}}
    fused = {"meshes": {"2": "1x2"}, "entries": [{"chips": 2, "batch": 8, "fastest": "ep_router", "layouts": {
        "vllm_fused_ep_moe": {**layer, "block_sizes": {"bt": 4, "bf": 768, "bd1": 2048, "bd2": 1024}},
        "ep_router": {**layer, "layer_us": 33.5, "per_layer_us": {"low": 40.0, "central": 45.5, "high": 51.0}},
        "ep_dispatch": {"error": "lowering failed: no"}}}]}
    tables = multichip_tables.render_markdown({"entries": entries, "winner_per_batch": winners, "method": method,
                                               "fused_ep_moe": fused})
    assert tables["fused-ep-moe-against-ours"].splitlines()[2] == (
        "| 2 (1x2) | 8 | 62.0 (55.0-80.0) = 50.0 + 12.0 | **45.5 (40.0-51.0) = 33.5 + 12.0** | refused: no "
        "| 4/768/2048/1024 |")
    assert tables["step-ms-and-layer-parts"].splitlines()[0::2] == [
        "| batch | `tp` | `ep_router` | `ep_dispatch` | experts layer us (tp / router / dispatch) "
        "| collectives us per layer (tp / router / dispatch) |",
        "| 1 | **1.19** (0.59-2.37) | 1.96 (0.98-3.92) | 3.82 (1.91-7.63) | 11.9 / 19.6 / 38.2 | 1.2 / 2.0 / 3.8 |"]
    assert tables["step-ms-and-layer-parts"].splitlines()[3].startswith(
        "| 8 | 3.30 (1.65-6.59) | **3.16** (1.58-6.31) | 5.00 (2.50-10.00) |")
    assert tables["assumptions"].splitlines()[2:7] == [
        "| all-reduce | 2 (N-1)/N S / (2 W) | | |", "| mesh | 2x4, 4 hops across | | |",
        "| W, one link one way | 100 GB/s | | |", "| latency per hop | 1 µs | 0.5 µs | 2 µs |",
        "| host sync (`ep_dispatch`) | 30 µs | 10 µs | 100 µs |"]
    assert "Sources: the book." in tables["assumptions"]


def test_quantization_accuracy_table_from_its_json():
    figures = {"logits_max_abs_error": 0.02391, "logits_mean_abs_error": 0.00422, "greedy_tokens_equal": "36/64",
               "teacher_forced_tokens_equal": "57/64", "reference_median_margin": 0.033431}
    tables = quantization_accuracy_tables.render_markdown({"models": {"mixtral (H=128)": {"int4": figures}}})
    assert tables["errors"].splitlines()[2] == "| mixtral (H=128) | int4 | 2.4e-02 / 4.2e-03 | 36/64 | 57/64 | 0.033 |"


def test_loader_table_from_its_json():
    def load(ours_s: float, theirs_s: float, ours_requests: int, theirs_requests: int) -> dict:
        return {"ours": {"median_s": ours_s, "requests_per_load": ours_requests},
                "kernels": {"median_s": theirs_s, "requests_per_load": theirs_requests},
                "median_paired_ratio": 0.71}

    data = {"kernel": "org/ragged-dot-tpu", "variant": "torch-cpu", "files_in_variant": 44, "runs": 15,
            "environment": {"kernels": "0.19.1", "huggingface_hub": "2.4.0", "cpus": 2},
            "cold": load(0.2663, 0.3699, 48, 92), "warm": load(0.1655, 0.1775, 4, 3),
            "repeat_in_process": {"calls_per_loader": 200, "ours": {"median_s": 0.017}, "kernels": {"median_s": 0.0175},
                                  "ratio_ours_over_kernels": 0.97,
                                  "requests_per_load": {"ours": {"requests": 4}, "kernels": {"requests": 3}}},
            "offline": {"ours": {"median_s": 0.147, "requests_per_load": 0},
                        "kernels": "ValueError: Version 1 is not available in the local cache"},
            "digest_check_median_s": 0.0025, "digest_check_and_private_copy_median_s": 0.004}
    rows = loader_tables.render_markdown(data)["loads"].splitlines()
    assert rows[2] == "| cold: empty cache, new process | 266.3 | 369.9 | 0.71 | 48 / 92 |"
    assert rows[5] == "| offline (`HF_HUB_OFFLINE=1`, cached) | 147.0 | refuses: ValueError | | 0 / not counted |"
    assert rows[7] == "| of which: digest check and private copy | 4.0 | | | |"


def test_hub_server_tables_put_each_round_before_and_after_and_say_capped():
    def round_of(body_memory: dict, tree_listing: dict) -> dict:
        return {"body_memory": body_memory, "tree_listing": tree_listing, "slow_body": {"held_s": 2.0, "outcome": "408"}}

    data = {"attacks": {"before": round_of({"rss_growth_while_held_mib": 1050.3, "peak_rss_growth_mib": 1507.9},
                                           {"25000_folders": {"page_s": 84.33, "recursive_walk_s": None}}),
                        "after": round_of({"rss_growth_while_held_mib": 20.9, "peak_rss_growth_mib": 23.0},
                                          {"25000_folders": {"page_s": 0.14, "recursive_walk_s": 0.15}})},
            "faults": {"before": {"commit_memory": {"64_mib": {"server_peak_rss_growth_mib": 280.4},
                                                    "256_mib": {"server_peak_rss_growth_mib": 1240.7}}},
                       "after": {"commit_memory": {"64_mib": {"server_peak_rss_growth_mib": 0.0},
                                                   "256_mib": {"server_peak_rss_growth_mib": 0.5}}}},
            "cards": {"before": {"card_page": {"page_mb": 205.09}}, "after": {"card_page": {"page_mb": 1.03}}},
            "pages": {"before": {"table_card": {"first_view": {"cpu_s": 14.31, "peak_rss_growth_mib": 1060.4},
                                                "second_view": {"cpu_s": 0.0}}},
                      "after": {"table_card": {"first_view": {"cpu_s": 0.79, "peak_rss_growth_mib": 47.9},
                                               "second_view": {"cpu_s": 0.0}}}}}
    tables = hub_server_tables.render_markdown(data)
    memory = tables["slow-clients-and-memory"].splitlines()
    assert memory[0] == "| measured | group | before | after |"
    assert memory[3].endswith("| attacks | 1050.3 / 1507.9 | 20.9 / 23.0 |")
    assert memory[5] == ("| one-file commits of 64 / 256 MiB: server peak RSS growth, MiB | faults "
                         "| 280.4 / 1240.7 | 0.0 / 0.5 |")
    assert "| attacks | 84.33 / capped | 0.14 / 0.15 |" in tables["listings"]
    assert "| cards | 205.09 | 1.03 |" in tables["cards"]
    # A case missing from a round's run reads as capped, never a KeyError.
    assert "| pages | 14.31 / 1060.4 / 0.0 | 0.79 / 47.9 / 0.0 |" in tables["costly-pages"]
    assert "| pages | capped / capped | capped / capped |" in tables["costly-pages"]


def test_rmsnorm_tables_take_the_worst_ratio_over_sizes_and_generations(monkeypatch):
    monkeypatch.setattr(rmsnorm_tables, "KERNELS", {"rms_norm": "RMSNorm", "rms_norm_backward": "RMSNorm backward"})

    def result(kernel: str, hidden: int, rows: int, v5e_ratio: float, v6e_ratio: float, v6e_pct: float) -> dict:
        return {"kernel": kernel, "hidden": hidden, "rows": rows,
                "per_generation": {"v5e": {"bytes_ratio": v5e_ratio, "pct_of_roofline": 50.0},
                                   "v6e": {"bytes_ratio": v6e_ratio, "pct_of_roofline": v6e_pct}}}

    results = [result("rms_norm", 2048, 1, 1.5, 1.5, 1.4), result("rms_norm", 2048, 64, 1.0078, 1.0078, 45.1),
               result("rms_norm", 2048, 8192, 1.0001, 1.0001, 91.6),
               result("rms_norm", 7168, 8192, 1.0001, 1.0001, 93.6),
               result("rms_norm_backward", 7168, 8192, 1.014, 1.0052, 90.4)]
    layouts = {"results": [{"shape": [8, 128, 4096], "dtype": "bfloat16", "relayout_copies": 0,
                            "bytes_accessed_over_min": 1.002},
                           {"shape": [2, 7, 4096], "dtype": "float32", "relayout_copies": 2,
                            "bytes_accessed_over_min": 5.616}]}
    tables = rmsnorm_tables.render_markdown({"results": results, "v6e_nd_input_layouts": layouts})
    assert tables["traffic"].splitlines()[2:] == ["| RMSNorm | 1.500x | 1.008x | 92–94 % |",
                                                  "| RMSNorm backward | not run | 1.014x | 90 % |"]
    assert tables["relayouts"].splitlines()[2:] == ["| (2, 7, 4096) | float32 | 2 | 5.6x |"]
    with pytest.raises(KeyError, match="no result for rms_norm_backward"):
        rmsnorm_tables.render_markdown({"results": results[:1], "v6e_nd_input_layouts": layouts})


def test_int4_granularity_table_from_its_json():
    def tokens(*equal: str) -> dict:
        return {scheme: {"greedy_tokens_equal": kept} for scheme, kept in zip(int4_granularity_tables.SCHEMES, equal)}

    models = {"gpt_oss (H=128)": tokens("64/64", "20/64", "20/64", "7/64", "30/64"),
              "qwen3_moe (H=128)": tokens(*["64/64"] * 5), "mixtral (H=128)": tokens(*["1/64"] * 5)}
    assert int4_granularity_tables.render_markdown({"models": models}) == {"greedy-tokens": "\n".join([
        "| model | int8 | int4 per channel | groups of 128 | of 64 | of 32 |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        "| Qwen3-MoE | 64/64 | 64/64 | 64/64 | 64/64 | 64/64 |",
        "| Mixtral | 1/64 | 1/64 | 1/64 | 1/64 | 1/64 |",
        "| GPT-OSS | 64/64 | 20/64 | 20/64 | 7/64 | 30/64 |"])}


def moe_layer_shape(label: str, generation: str, ours_us: float) -> dict:
    return {"label": label, "generation": generation, "ours_us": ours_us,
            "ours_band_p90_us": [ours_us - 5, ours_us + 5], "best_rival_us": 2 * ours_us, "best_rival": "megablox",
            "roofline_us": ours_us / 2}


def test_moe_layer_headline_table_from_its_json():
    shapes = [moe_layer_shape(label, generation, us) for label, generation, us in (
        ("b T=8", "v5e", 100.0), ("b T=8", "v6e", 50.0), ("a T=1", "v6e", 10.0), ("a T=1", "v5e", 20.0))]
    assert moe_layer_tables.headline({"shapes": shapes}, ("v5e", "v6e")) == "\n".join([
        "| shape | v5e | v6e |", "| --- | --- | --- |",
        "| b T=8 | 100.0 (95-105) / 200.0 (megablox) / 50.0 | 50.0 (45-55) / 100.0 (megablox) / 25.0 |",
        "| a T=1 | 20.0 (15-25) / 40.0 (megablox) / 10.0 | 10.0 (5-15) / 20.0 (megablox) / 5.0 |"])


def test_moe_layer_targets_tables_from_its_json():
    anchor = {"ours_us": 98.2, "ours_band_p90_us": [92.6, 103.8], "target_pct_of_floor_at_share": 95.0, "meets": True,
              "meets_across_p90_band": False, "best_rival_us": 117.1, "best_rival": "megablox", "roofline_us": 93.4,
              "hbm_share": 0.9, "floor_at_share_us": 103.778, "ours_pct_of_floor_at_share": 105.68}
    priced_at = {"hbm_fraction": {"v6e": 0.9}, "grid_step_us": {"v6e": 0.0217}}
    targets = {
        "anchor": {"a 256 v6e": anchor},
        "decode": [{"label": "a T=1", "generation": "v6e", "meets": True, "ours_over_roofline": 1.05},
                   {"label": "b T=1", "generation": "v5e", "meets": False, "ours_over_roofline": 1.18}],
        "decode_max_over_roofline": 1.08, "decode_meets": 1, "decode_shapes": 2,
        "quantized": {"max_bytes_over_quantized_min": 1.05, "decode_meets": 6, "decode_shapes": 6},
        "rival_wins": [],
    }
    data = {"targets": targets, "priced_at": priced_at}
    assert moe_layer_tables.anchor(data).splitlines()[2] == (
        "| a 256 v6e | 98.2 (92.6-103.8) | 93.4 | 0.9 | 103.8 | 105.7 | 95 | yes | yes | 117.1 (megablox) |")
    # A JSON that does not say what it was priced at was priced before v6e's own data: at a share of 1.
    del data["priced_at"]
    assert moe_layer_tables.anchor(data).splitlines()[2].startswith("| a 256 v6e | 98.2 (92.6-103.8) | 93.4 | 1 | 93.4 ")
    assert moe_layer_tables.decode_targets(data).splitlines() == [
        "| decode target | met |", "| --- | --- |", "| bf16 within 1.08x of the roofline | 1 of 2 |",
        "| int8 / fp8 / int4 bytes within 1.05x of the quantized minimum | 6 of 6 |", "",
        "| missed: shape | gen | ours / roofline |", "| --- | --- | ---: |", "| b T=1 | v5e | 1.180 |"]
    assert moe_layer_tables.rival_wins(data) == "No tuned rival is faster than ours at any shape."
    targets["rival_wins"] = [{"label": "c T=2048", "generation": "v6e", "rival": "megablox", "rival_wins_by_pct": 2.14,
                              "why": "grouped-matmul us"}]
    assert moe_layer_tables.rival_wins(data).splitlines()[2] == "| c T=2048 | v6e | megablox | 2.1 | grouped-matmul us |"


def test_calibration_tables_count_refusals_per_chip_and_kind_but_not_missing_timings():
    stats = {"count": 16, "median_abs_error": 0.0198, "p90_abs_error": 0.0568, "worst": {"ratio": 0.8979},
             "median_signed_error": -0.0153, "mean_signed_error": -0.0241}
    summary = {"v5e": {"pallas_ragged_dot": {"all": stats,
                                             "fit": {"count": 7, "median_abs_error": 0.0219, "p90_abs_error": 0.05},
                                             "holdout": {"count": 9, "median_abs_error": 0.0147,
                                                         "p90_abs_error": 0.06}}}}
    folder = "site-packages/tokamax/data/autotuning/tpu_v5_lite"
    skipped = [{"file": f"{folder}/pallas_mosaic_tpu_ragged_dot.json", "reason": "inconsistent inputs: the tiles"},
               {"file": f"{folder}/pallas_mosaic_tpu_ragged_dot.json", "reason": "inconsistent inputs: other"},
               {"file": f"{folder}/pallas_mosaic_tpu_ragged_dot.json", "reason": "no timing recorded"},
               {"file": f"{folder}/ragged_dot.json", "reason": "not modelled: empty bounds"}]
    constants = {"what": "x", "grid_step_s": {"v5e": 3.4e-7, "v6e": 3.4e-7, "v5p": 3.4e-7, "tpu7x": 7.2e-7},
                 "grid_step_s_note": "v5e and TPU7x fitted", "mxu_weight_load_fraction": 0.125}
    hbm = {"hbm_fraction": {"v5e": 0.9, "v6e": 0.9}, "hbm_fraction_note": {"v5e": "fitted", "v6e": "borrowed from v5e"}}
    tables = calibration_tables.render_markdown({"summary": summary, "skipped": skipped}, constants, hbm)
    assert tables["error"].splitlines()[2] == (
        "| v5e | pallas_ragged_dot | 16 | 2 inconsistent inputs | 2.0 % | 5.7 % | -1.5 % / -2.4 % | 0.90 "
        "| 7, 2.2 % / 5.0 % | 9, 1.5 % / 6.0 % |")
    rows = tables["constants"].splitlines()
    assert rows[0] == "| per device | v5e | v6e | v5p | tpu7x | source |"
    assert "| `grid_step_s` | 0.34 µs | 0.34 µs | 0.34 µs | 0.72 µs | v5e and TPU7x fitted |" in rows
    assert "| `mxu_weight_load_fraction` | 0.125 | 0.125 | 0.125 | 0.125 |  |" in rows
    assert not any("what" in row for row in rows)
    assert "| `hbm_fraction` | 0.9 | 0.9 | none | none | fitted: see below |" in rows
    assert rows[-2:] == ["- `hbm_fraction`, v5e: fitted", "- `hbm_fraction`, v6e: borrowed from v5e"]


def test_moe_layer_v5p_tpu7x_table_adds_the_quantized_formats_and_the_fused_rival(monkeypatch):
    monkeypatch.setattr(moe_layer_tables, "V5P_TPU7X_SHAPES", ("a T=1",))
    shapes = [moe_layer_shape("a T=1", "v5p", 30.0), moe_layer_shape("a T=1", "tpu7x", 20.0)]
    variants = [{"generation": generation, "label": "a T=1", "variant": f"ours_{fmt}", "us": us}
                for generation, fmt, us in (("v5p", "int8", 17.8), ("v5p", "fp8", 18.2), ("v5p", "int4", 10.2),
                                            ("tpu7x", "int8", 16.8), ("tpu7x", "fp8", 16.4))]
    sizes = {"bt": 8, "btc": 8, "bf": 384, "bd1": 1024, "bd2": 1024}
    variants += [{"generation": "tpu7x", "label": "a T=1", "variant": "vllm_fused_ep_moe", "compiled": False,
                  "error": "lowering failed: Expected num_tokens=1 to be aligned to ep_size=8."},
                 {"generation": "v5p", "label": "a T=1", "variant": "ours", "us": 30.0},
                 {"generation": "v5p", "label": "a T=1", "variant": "vllm_fused_ep_moe", "us": 40.0,
                  "block_sizes": sizes, "block_sizes_from": "searched"}]
    tables = moe_layer_tables.render_v5p_tpu7x_markdown({"shapes": shapes, "variants": variants})
    assert tables == {"headline-and-quantized": "\n".join([
        "| shape | v5p | int8 / fp8 / int4 | TPU7x | int8 / fp8 |", "| --- | --- | --- | --- | --- |",
        "| a T=1 | 30.0 (25-35) / 60.0 (megablox) / 15.0 | 17.8 / 18.2 / 10.2 "
        "| 20.0 (15-25) / 40.0 (megablox) / 10.0 | 16.8 / 16.4 |"]), "vllm-fused": "\n".join([
        "| shape | v5p: µs (ours / it), blocks | tpu7x: µs (ours / it), blocks |", "| --- | --- | --- |",
        "| a T=1 | 40.0 (0.75), bt 8/8, bf 384, bd 1024/1024 "
        "| no figure: lowering failed: Expected num_tokens=1 to be aligned to ep_size=8. |"])}
    assert moe_layer_tables.render_v5p_markdown({"shapes": shapes, "variants": variants}) == {
        "vllm-fused": tables["vllm-fused"]}
    # A row priced at vLLM's own block sizes (before the search, or where none fits) says so.
    variants[-1] = {**variants[-1], "block_sizes_from": "default formula (not in its tuned table)"}
    assert moe_layer_tables.render_v5p_markdown({"shapes": shapes, "variants": variants})["vllm-fused"].endswith(
        "bd 1024/1024 (vLLM's pick) | no figure: lowering failed: Expected num_tokens=1 to be aligned to ep_size=8. |")


def test_the_docs_include_the_tables_rendered_from_the_benchmarks_json():
    sources = set()
    pages = [path.relative_to(ROOT).as_posix() for path in (ROOT / report.PAGES_DIR).glob("*.md")]
    for doc in ("docs/binding.md", "kernel_repos/attention-tpu/CARD.md", "docs/multichip.md", *pages,
                "docs/kernelize.md", "docs/hub.md", "README.md", "kernel_repos/rmsnorm-tpu/CARD.md",
                "docs/security.md"):
        blocks, _ = report.find_blocks(doc, (ROOT / doc).read_text())
        sources |= {block.source for block in blocks}
    assert sources >= {"benchmarks/results/binding.md#cost-per-call",
                       "benchmarks/results/binding.md#tpu-path", "benchmarks/results/attention.md#forward",
                       "benchmarks/results/attention.md#backward",
                       "benchmarks/results/attention.md#per-generation",
                       "benchmarks/results/attention.md#backward-mxu-work",
                       "benchmarks/results/multichip.md#step-ms-and-layer-parts",
                       "benchmarks/results/int4_granularity.md#greedy-tokens",
                       "benchmarks/results/moe_layer_headline.md#headline",
                       "benchmarks/results/moe_layer_headline.md#anchor",
                       "benchmarks/results/moe_layer_headline.md#hf-257us",
                       "benchmarks/results/calibration.md#error", "benchmarks/results/calibration.md#constants",
                       "benchmarks/results/multichip.md#assumptions", "benchmarks/results/loader.md#loads",
                       "benchmarks/results/quantization_accuracy.md#errors",
                       "benchmarks/results/quantization_accuracy_tpu7x.md#errors",
                       "benchmarks/results/moe_layer_formats.md#per-chip",
                       "benchmarks/results/moe_layer_v5p_tpu7x_headline.md#headline-and-quantized",
                       "benchmarks/results/moe_layer_v5p_tpu7x_headline.md#vllm-fused",
                       "benchmarks/results/moe_layer_v5p_headline.md#vllm-fused",
                       "benchmarks/results/decode_step.md#step", "benchmarks/results/decode_step.md#terms",
                       "benchmarks/results/decode_step.md#gaps", "benchmarks/results/decode_step.md#hf-kernel",
                       "benchmarks/results/decode_step.md#host",
                       "benchmarks/results/decode_step.md#assumptions",
                       "benchmarks/results/hub_server.md#slow-clients-and-memory",
                       "benchmarks/results/hub_server.md#listings", "benchmarks/results/hub_server.md#cards",
                       "benchmarks/results/rmsnorm.md#traffic", "benchmarks/results/rmsnorm.md#relayouts"}


def test_cli_runs_report_as_a_bench_tool(tmp_path, monkeypatch, capsys):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):  # what the derived tables are rendered from
        shutil.copy(path, results / path.name)
    # The speed picture's drawing and check have tests of their own (test_bench_speed_picture.py): not redrawn here.
    monkeypatch.setattr(report, "PICTURES", {})
    facts = json.loads((ROOT / prose_figures.FACTS).read_text())  # the README's facts: its other docs are not here
    (tmp_path / prose_figures.FACTS).parent.mkdir()
    (tmp_path / prose_figures.FACTS).write_text(json.dumps({"README.md": facts["README.md"]}))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", "--check"]) == 1  # the derived tables are not written yet
    assert cli.main(["report"]) == 0
    assert cli.main(["report", "--check"]) == 0
    assert cli.main(["--help"]) == 0
    assert "report" in capsys.readouterr().out
