"""Hardening V (issue 73): `python -m benchmarks calibrate --from-benchmark` on a stranger's file (CB1-CB6). The README
asks TPU owners to attach these files to issues, so maintainers run them on files they did not write."""

import json
import math

import pytest

from benchmarks.cli import main

GOOD = {"workload": "InterpretModeRMSNorm.rms_norm_h256_r16",
        "timingResults": {"min_ms": 1.0, "mean_ms": 1.5, "iterations": 5}, "verified": True}
OSC_52 = "\x1b]52;c;ZWNobyBvd25lZA==\x07"  # writes the clipboard
C1_CSI = "\x9b2J"  # clears the screen, on terminals that take 8-bit controls


def with_result(**changes) -> dict:
    timing = {**GOOD["timingResults"], **changes.pop("timing", {})}
    return {"results": [{**GOOD, **changes, "timingResults": timing}]}


HOSTILE = {
    "nesting 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "a list, not an object": "[]",
    "results not a list": json.dumps({"results": {"a": 1}}),
    "a result not an object": json.dumps({"results": [7]}),
    "workload an int": json.dumps(with_result(workload=7)),
    "workload a list": json.dumps(with_result(workload=["a", "b"])),
    "workload with OSC 52": json.dumps(with_result(workload=f"A.b{OSC_52}")),
    "workload with a C1 control": json.dumps(with_result(workload=f"A.b{C1_CSI}")),
    "workload too long": json.dumps(with_result(workload="A." + "b" * 300)),
    "workload empty": json.dumps(with_result(workload="")),
    "iterations Infinity": json.dumps(with_result(timing={"iterations": math.inf})),
    "iterations a fraction": json.dumps(with_result(timing={"iterations": 2.5})),
    "iterations true": json.dumps(with_result(timing={"iterations": True})),
    "iterations zero": json.dumps(with_result(timing={"iterations": 0})),
    "min_ms NaN": json.dumps(with_result(timing={"min_ms": math.nan})),
    "min_ms a string": json.dumps(with_result(timing={"min_ms": "fast"})),
    "mean_ms Infinity": json.dumps(with_result(timing={"mean_ms": math.inf})),
    "verified a string": json.dumps(with_result(verified="yes")),
    "a key with escapes": json.dumps({"results": [{OSC_52: 1}], OSC_52: C1_CSI}),
    "not UTF-8": b"\xff\xfe{",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_results_file_is_one_line_and_exit_2(tmp_path, capsys, name):
    path = tmp_path / "results.json"
    content = HOSTILE[name]
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    returncode = main(["calibrate", "--from-benchmark", str(path), "--chip", "v6e", "--out", str(tmp_path / "o.json")])
    printed = capsys.readouterr()
    assert returncode == 2, printed
    assert len(printed.err.splitlines()) == 1 and printed.out == "", printed
    assert not any(0 <= ord(c) < 32 or 127 <= ord(c) < 160 for c in printed.err.rstrip("\n")), printed.err
    assert not (tmp_path / "o.json").exists()


def test_too_many_results_or_bytes_are_refused_before_any_analysis(tmp_path, capsys):
    many = tmp_path / "many.json"
    many.write_text(json.dumps({"results": [GOOD] * 4097}))
    large = tmp_path / "large.json"
    large.write_text(json.dumps({"results": [GOOD], "padding": "x" * (16 << 20)}))
    for path, said in ((many, "more than 4096"), (large, "larger than 16 MiB")):
        assert main(["calibrate", "--from-benchmark", str(path), "--chip", "v6e"]) == 2
        assert said in capsys.readouterr().err


def test_each_distinct_workload_is_analysed_once_at_its_fastest_timing(tmp_path, monkeypatch):
    from benchmarks.studies import from_benchmark

    analysed = []
    monkeypatch.setattr(from_benchmark, "_analyse_ours", lambda result, timed, chip, repos: analysed.append(timed))
    paths = []
    for copy in range(2):
        path = tmp_path / f"copy{copy}.json"
        path.write_text(json.dumps({"results": [
            {**GOOD, "timingResults": {**GOOD["timingResults"], "min_ms": 1.0 + index + copy}}
            for index in range(1000)]}))
        paths.append(path)
    from_benchmark.analyse(paths, "v6e")
    ((only,),) = analysed
    assert (only.workload, only.min_ms, only.source) == (GOOD["workload"], 1.0, str(paths[0]))


def test_the_report_is_valid_json_with_null_for_numbers_that_are_not_finite(tmp_path):
    from benchmarks.perf import calibration

    out = tmp_path / "report.json"
    calibration.write_report({"entries": [{"ratio": math.inf}], "summary": {"v6e": {"worst": -math.inf}},
                              "skipped": [], "moves": {"x": math.nan}}, out)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    report = json.loads(out.read_text(), parse_constant=refuse)
    assert report == {"entries": [{"ratio": None}], "summary": {"v6e": {"worst": None}}, "skipped": [],
                      "moves": {"x": None}}


def test_what_is_printed_has_its_control_characters_escaped():
    from benchmarks.studies import from_benchmark

    report = {"entries": [], "skipped": [{"workload": "A.b", "reason": f"why{OSC_52}{C1_CSI}"}], "moves": {},
              "model_constant_points": [], "model_constant_fits": {}}
    printed = from_benchmark.printed(report)
    assert "\x1b" not in printed and "\x9b" not in printed and "\\x1b]52;c;" in printed and "\\x9b2J" in printed
