"""No figure typed into prose: `python -m benchmarks report --check` finds them (benchmarks/studies/prose_figures.py)."""

import json
from pathlib import Path

import pytest

from benchmarks.studies import prose_figures, report

from .test_bench_report import ROOT, TABLE, checkout, write_doc  # noqa: F401 - fixture


def write_facts(root: Path, facts: dict) -> None:
    (root / "docs").mkdir(exist_ok=True)
    (root / prose_figures.FACTS).write_text(json.dumps(facts))


@pytest.mark.parametrize("figure", ["1.23x", "3x", "3×", "2.5 ×", "12 µs", "12 μs", "12us", "4.5 ms", "30 s",
                                    "2 seconds", "85 %", "9%", "1.64 TB/s", "16 KiB/s", "900 TFLOP/s",
                                    "1,200 tokens/s", "470 MB", "64 MiB", "1 GiB"])
def test_a_figure_is_found_in_prose(figure):
    assert [found.group() for found in prose_figures.FIGURE.finditer(f"it takes {figure}, here.")] == [figure]


@pytest.mark.parametrize("text", ["TPU7x and tpu7x", "v5e", "blocks of 8x128", "a 64 × 65536 case", "0x1F",
                                  "jax 0.10.2", "Python 3.11", "`hbm85_us`", "3 users", "2 steps", "ratio 2.2",
                                  "25,000 operations", "v1.5x"])
def test_a_version_shape_or_count_is_no_figure(text):
    assert not prose_figures.FIGURE.search(text)


def test_check_fails_on_a_figure_typed_in_prose_naming_file_and_line(checkout, capsys):
    write_doc(checkout, f"intro\n\n<!-- generated: benchmarks/results/layer.md -->\n{TABLE}<!-- end generated -->\n"
                        "\nOurs takes 12.5 µs,\nthat is 1.3x faster than theirs.\n")
    assert report.main(["--check", "--root", str(checkout)]) == 1
    err = capsys.readouterr().err
    assert "README.md:9: figure `12.5 µs` typed in prose" in err
    assert "README.md:10: figure `1.3x` typed in prose" in err
    assert len(report.problems(checkout)) == 2


def test_a_figure_in_a_generated_block_or_a_code_fence_passes(checkout):
    write_doc(checkout, "<!-- generated: benchmarks/results/two.md#first -->\n| x |\n| --- |\n| 1 |\n"
                        "<!-- end generated -->\n\n```\n$ run  # 12 µs, 1.3x\n```\n\n- item\n\n  ~~~~\n  85 %\n"
                        "  ~~~\n  still code: 3x\n  ~~~~\n\nNo figure here.\n")
    assert report.problems(checkout) == []
    # The same figures in a block that no longer matches its source: the block differs, the prose stays clean.
    write_doc(checkout, "<!-- generated: benchmarks/results/two.md#first -->\n| x |\n| --- |\n| 12 µs |\n"
                        "<!-- end generated -->\n")
    assert report.problems(checkout) == ["README.md:1: block differs from its source benchmarks/results/two.md#first"]


def test_an_allowed_fact_passes_but_a_figure_typed_beside_it_fails(checkout):
    write_doc(checkout, "Headers must arrive within\n10 s of connecting; VMEM is 64 MiB.\n")
    write_facts(checkout, {"README.md": {"arrive within 10 s of": "the header timeout's default",
                                         "VMEM is 64 MiB": "a hardware constant"}})
    assert report.problems(checkout) == []
    write_doc(checkout, "Headers must arrive within\n10 s of connecting (in 2.1 ms); VMEM is 64 MiB.\n")
    assert report.problems(checkout) == ["README.md:2: figure `2.1 ms` typed in prose: include it from a generated "
                                         f"block, reword, or allow it as a fact in {prose_figures.FACTS}"]
    # A phrase allows only the figures wholly inside it.
    write_facts(checkout, {"README.md": {"arrive within 10 s of": "the header timeout's default",
                                         "VMEM is 64": "cuts the figure"}})
    assert [problem.partition(" typed")[0] for problem in report.problems(checkout)] == [
        f"README.md: the fact `VMEM is 64` ({prose_figures.FACTS}) holds no figure: drop it",
        "README.md:2: figure `2.1 ms`", "README.md:2: figure `64 MiB`"]


def test_a_fact_that_no_prose_holds_fails(checkout):
    write_doc(checkout, "VMEM is 64 MiB.\n\n```\ntimeout 30 s\n```\n")
    write_facts(checkout, {"README.md": {"VMEM is 64 MiB": "a hardware constant", "VMEM is": "no figure in it",
                                         "timeout 30 s": "only in code", "VMEM is 128 MiB": "reworded since"},
                           "docs/gone.md": {"1 s": "a doc that is not tracked"}})
    assert sorted(report.problems(checkout)) == sorted([
        f"{prose_figures.FACTS}: docs/gone.md is not a tracked doc: drop its facts",
        f"README.md: the fact `VMEM is` ({prose_figures.FACTS}) holds no figure: drop it",
        f"README.md: the fact `timeout 30 s` ({prose_figures.FACTS}) is no longer in its prose: drop or fix it",
        f"README.md: the fact `VMEM is 128 MiB` ({prose_figures.FACTS}) is no longer in its prose: drop or fix it"])


def test_a_fact_without_a_reason_fails(checkout):
    write_doc(checkout, "VMEM is 64 MiB.\n")
    write_facts(checkout, {"README.md": {"VMEM is 64 MiB": " "}})
    assert report.problems(checkout) == [f"{prose_figures.FACTS}: README.md: the fact `VMEM is 64 MiB` gives no reason"]


def test_the_repos_docs_type_no_figure_in_prose():
    assert report.typed_figures(ROOT) == []
