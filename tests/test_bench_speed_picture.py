"""The README's speed picture (`benchmarks.studies.tables.speed`): its figures from the studies' JSON, and `bench
report --check` telling a picture drawn from the current JSON from a stale one by the digest in its metadata."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.studies import report
from benchmarks.studies.tables import speed

CASE = "qwen3-30b-a3b EP8 router-masking T=64"
FRAGILE = f"{CASE}: ours at most the best tuned rival"


def shape_and_variants(generation: str, ours_us: float) -> tuple[dict, list[dict]]:
    shape = {"label": CASE, "generation": generation, "ours_us": ours_us, "ours_band_p90_us": [ours_us - 5, ours_us + 5],
             "best_rival": "megablox", "best_rival_us": ours_us + 20}
    rival = {"label": CASE, "generation": generation, "variant": "megablox", "band_p90_us": [ours_us + 15, ours_us + 25]}
    return shape, [rival]


@pytest.fixture
def studies(tmp_path, monkeypatch):
    """A checkout whose results hold one experts headline and one MLA headline."""
    monkeypatch.setattr(speed, "HEADLINES", (speed.Headline("qwen3-30b-a3b", "Qwen3", "experts", CASE),
                                             speed.Headline("glm-4.7-flash", "GLM", "mla")))
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for run, generations in speed.MOE_LAYER_RUNS.items():
        lines = [shape_and_variants(generation, 100.0 + index) for index, generation in enumerate(generations)]
        (results / run).write_text(json.dumps({"shapes": [shape for shape, _ in lines],
                                               "variants": [v for _, variants in lines for v in variants]}))
    terms = [{"term": "batched_mm: gather", "us_per_call": 3000.0}, {"term": "batched_mm: bmm", "us_per_call": 1000.0},
             {"term": "full attention: softmax attention (XLA)", "us_per_call": 500.0}]
    (results / "decode_step.json").write_text(json.dumps({"method": {"generation": "v6e"}, "models": {
        "qwen3-30b-a3b": {"hf_kernel_check": {"experts_case": CASE},
                          "paths": {"transformers_default": {"terms": terms}}}}}))
    mla = {"model": "glm-4.7-flash", "call": speed.MLA_CALL, "generation": "v6e", "model_pick": "absorbed",
           "ours_us": 240.0, "absorbed": {"band_p90_us": [190.0, 300.0]}, "transformers": {"us": 27000.0},
           "vllm_mla": {"best": {"us": 220.0, "band_p90_us": [170.0, 270.0]}}}
    (results / "mla.json").write_text(json.dumps({"results": [mla, {**mla, "call": "prefill 4096 from empty"}]}))
    claims = [{"family": "moe_layer ranking", "claim": FRAGILE, "generation": "v6e", "verdict": "fragile"},
              {"family": "moe_layer ranking", "claim": FRAGILE, "generation": "v5e", "verdict": "robust"},
              {"family": "moe_layer ranking", "claim": "gpt-oss-20b T=64: ours at most the best tuned rival",
               "generation": "v6e", "verdict": "fragile"}]
    (results / "robustness.json").write_text(json.dumps({"claims": claims}))
    return tmp_path


def test_each_headline_takes_ours_the_rival_the_default_path_and_the_fragile_claims_at_its_point(studies):
    experts, mla = speed.bars(studies)
    assert [point["generation"] for point in experts["points"]] == list(speed.GENERATIONS)
    by_generation = {point["generation"]: point for point in experts["points"]}
    # transformers' batched_mm experts per layer: decode_step's default terms, on the one chip it prices.
    assert by_generation["v6e"]["bars"][0] == {"path": "default", "name": "transformers' batched_mm", "us": 4000.0,
                                               "band_p90_us": None}
    assert [bar["path"] for bar in by_generation["tpu7x"]["bars"]] == ["ours", "rival"]
    assert by_generation["v6e"]["fragile"] == [FRAGILE] and by_generation["v5e"]["fragile"] == []
    assert by_generation["v5e"]["bars"][1] == {"path": "rival", "name": "megablox", "us": 120.0,
                                               "band_p90_us": [115.0, 125.0]}
    assert [bar["path"] for bar in mla["points"][0]["bars"]] == ["default", "ours", "rival"]
    table = speed.render_markdown([experts, mla])["bars"]
    assert "| Qwen3 | qwen3-30b-a3b EP8 router-masking T=64 | v5p | not modelled | 100.0 (95.0-105.0) |" in table
    assert "| GLM | decode B=64 cache=4096 | v6e | 27,000.0 (no band) | 240.0 (190.0-300.0) |" in table


def test_a_headline_its_study_does_not_price_is_named(studies):
    decode_step = studies / "benchmarks" / "results" / "decode_step.json"
    data = json.loads(decode_step.read_text())
    data["models"]["qwen3-30b-a3b"]["hf_kernel_check"]["experts_case"] = "qwen3-30b-a3b EP8 dispatch T=64"
    decode_step.write_text(json.dumps(data))
    with pytest.raises(speed.MissingFigure, match="decode_step's experts case for qwen3-30b-a3b"):
        speed.bars(studies)


def test_the_digest_is_read_back_from_the_pngs_metadata(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(0.2, 0.2))
    figure.savefig(tmp_path / "tiny.png", metadata={speed.DIGEST_KEY: "ab12", "Title": "other"})
    plt.close(figure)
    assert speed.stored_digest(tmp_path / "tiny.png") == "ab12"
    assert speed.stored_digest(tmp_path / "missing.png") is None


def test_check_fails_on_a_picture_not_drawn_from_the_current_json_and_report_redraws_it(tmp_path, monkeypatch):
    figures = tmp_path / "figures.json"
    figures.write_text('{"us": 1.0}')
    drawn = []

    def draw(found, path: Path, digest: str) -> None:
        drawn.append(found)
        path.write_text(digest)  # stands in for the PNG and its metadata

    picture = SimpleNamespace(bars=lambda root: json.loads(figures.read_text()), inputs_digest=lambda found: str(found),
                              stored_digest=lambda path: path.read_text() if path.is_file() else None, draw=draw)
    monkeypatch.setattr(report, "DERIVED_TABLES", {})
    monkeypatch.setattr(report, "PICTURES", {"benchmarks/results/speed.png": picture})
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    stale = "benchmarks/results/speed.png was not drawn from the current JSON (the digest in its metadata differs)"
    assert report.problems(tmp_path) == [stale]
    report.refresh(tmp_path)
    assert drawn == [{"us": 1.0}] and report.problems(tmp_path) == []
    report.refresh(tmp_path)
    assert len(drawn) == 1  # a current picture is not drawn again
    figures.write_text('{"us": 2.0}')  # the study ran again
    assert report.problems(tmp_path) == [stale]
    figures.unlink()
    assert report.problems(tmp_path) == [f"benchmarks/results/speed.png cannot be drawn from its JSON: [Errno 2] "
                                         f"No such file or directory: '{figures}'"]
