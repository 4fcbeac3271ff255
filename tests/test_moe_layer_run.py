"""`python -m benchmarks moe_layer`'s command line: what a run selects, where it writes, and the cold-time record."""

import json

from benchmarks.studies.moe_layer import run
from benchmarks.studies.moe_layer.shapes import ANCHOR, ANCHOR_DISPATCH, DECODE_TOKENS, PREFILL_TOKENS, SETTINGS


def shapes(cases) -> set[tuple[str, int]]:
    return {(case.setting.label, case.tokens) for case in cases}


def test_by_default_the_headline_shapes_only_into_their_own_file():
    args, cases = run.parse_args([])
    assert shapes(cases) == {(ANCHOR[0], ANCHOR[1]), (ANCHOR_DISPATCH[0], ANCHOR_DISPATCH[1]),
                             (ANCHOR[0], PREFILL_TOKENS[-1]), (ANCHOR_DISPATCH[0], PREFILL_TOKENS[-1])}
    assert args.out == run.HEADLINE_OUT
    assert shapes(cases[:1]) == {ANCHOR[:2]}  # the anchor first, as in the full sweep


def test_all_is_the_full_sweep_into_the_tracked_results():
    args, cases = run.parse_args(["--all"])
    assert shapes(cases) == {(setting.label, tokens) for setting in SETTINGS
                             for tokens in DECODE_TOKENS + PREFILL_TOKENS}
    assert args.out == run.DEFAULT_OUT


def test_a_chosen_subset_runs_as_asked_and_names_other_generations():
    args, cases = run.parse_args(["--generations", "v5p", "tpu7x", "--tokens", "1", "8"])
    assert shapes(cases) == {(setting.label, tokens) for setting in SETTINGS for tokens in (1, 8)}
    assert args.out.name == "moe_layer_v5p_tpu7x.json"
    args, cases = run.parse_args(["--settings", ANCHOR[0]])
    assert shapes(cases) == {(ANCHOR[0], tokens) for tokens in DECODE_TOKENS + PREFILL_TOKENS}
    assert args.out == run.DEFAULT_OUT


def facts(empty_at_start: bool, hits: int = 112) -> dict:
    return {"cache": {"hits": hits, "misses": 2000, "empty_at_start": empty_at_start}, "seconds": 2400.0, "cpus": 2,
            "jobs": 2,
            "versions": "jax=0.10.2", "load_average_1_5_15_min": {"start": [0.1, 0.1, 0.1], "end": [2, 2, 2]}}


def test_only_a_full_sweep_or_the_default_run_from_an_empty_cache_records_its_time(tmp_path):
    record = tmp_path / "moe_layer_cold_times.json"
    headline, _ = run.parse_args([])
    full, _ = run.parse_args(["--all"])
    subset, _ = run.parse_args(["--tokens", "256"])
    assert not run.record_cold_time(subset, facts(empty_at_start=True), record)
    assert not run.record_cold_time(full, facts(empty_at_start=False), record)
    assert not run.record_cold_time(headline, facts(empty_at_start=False), record)
    assert not record.exists()
    assert run.record_cold_time(full, facts(empty_at_start=True), record)
    assert run.record_cold_time(full, facts(empty_at_start=True, hits=0), record)
    assert run.record_cold_time(headline, facts(empty_at_start=True), record)
    runs = json.loads(record.read_text())["runs"]
    assert [entry["seconds"] for entry in runs] == [2400.0, 2400.0, 2400.0]
    assert [entry["run"] for entry in runs] == ["--all", "--all", "default (headline shapes)"]
    assert runs[0]["generations"] == ["v5e", "v6e"] and runs[0]["compiles_and_replays"] == 2000
    assert runs[0]["reused_within_the_run"] == 112
