"""`python -m benchmarks calibrate` on a hand-made timing folder holding both of tokamax's precision forms: the
entries it can read are modelled, the ones it cannot are in the report's skipped list with the reason, and nothing
raises.

tokamax 0.0.12 writes a ragged dot's precision as a pair of `lax.Precision` names and an attention's as one
`DotAlgorithmPreset` name per dot; later files (openxla/tokamax, 2026) write the attention's as a pair of
`lax.Precision` names per dot (`[["DEFAULT", "DEFAULT"], ["DEFAULT", "DEFAULT"]]`), on which an older calibrate
raised `TypeError: unhashable type: 'list'`.
"""

from __future__ import annotations

import json

import pytest

RAGGED = {"lhs": "bf16[8,128]", "rhs": "bf16[2,128,128]", "group_sizes": [4, 4],
          "ragged_dot_dimension_numbers": {"dot_dimension_numbers": [[[1], [1]], [[], []]],
                                           "lhs_ragged_dimensions": [0], "rhs_group_dimensions": [0]},
          "preferred_element_type": None, "return_residuals": False, "activation": None}
ATTENTION = {"q": "bf16[1,256,2,128]", "k": "bf16[1,256,2,128]", "v": "bf16[1,256,2,128]",
             "logits_dtype": "float32", "logits_scale": 0.088, "mask": {"is_causal": True},
             "normalize_output": True, "return_residuals": False}
ATTENTION_CONFIG = {"block_q": 128, "block_kv": 128, "block_kv_compute": 128, "q_layout": 1, "k_layout": 1,
                    "v_layout": 1, "use_base2_exp": True, "use_experimental_scheduler": False}
TIMED = {"evaluation_times_ms": [0.05, 0.04]}
# precision -> read (True) or skipped with the reason (False)
RAGGED_PRECISIONS = [(["DEFAULT", "DEFAULT"], True), ("BF16_BF16_F32", True),
                     ([["DEFAULT", "DEFAULT"], ["DEFAULT", "DEFAULT"]], False), (["FAST", "SLOW"], False)]
ATTENTION_PRECISIONS = [([["DEFAULT", "DEFAULT"], ["DEFAULT", "DEFAULT"]], True),
                        (["BF16_BF16_F32", "BF16_BF16_F32"], True), ([["NOPE", "NOPE"], "X"], False)]


def _timing_file(call: dict, precisions, config: dict) -> str:
    return json.dumps({json.dumps({**call, "precision": precision}): {json.dumps(config): TIMED}
                       for precision, _ in precisions})


@pytest.mark.aot
@pytest.mark.slow
def test_calibrate_reads_both_precision_forms_and_lists_what_it_cannot_read(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokamax")
    from benchmarks import cli

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "home").mkdir(mode=0o700)
    folder = tmp_path / "tpu7x"
    folder.mkdir()
    (folder / "ragged_dot.json").write_text(_timing_file(RAGGED, RAGGED_PRECISIONS, {}))
    (folder / "pallas_mosaic_tpu_flash_attention.json").write_text(
        _timing_file(ATTENTION, ATTENTION_PRECISIONS, ATTENTION_CONFIG))
    out = tmp_path / "calibration.json"
    status = cli.main(["calibrate", str(folder), "--out", str(out), "--jobs", "1"])
    error = capsys.readouterr().err
    assert status == 0 and "Traceback" not in error, error[-2000:]
    report = json.loads(out.read_text())
    kinds = sorted(entry["kind"] for entry in report["entries"])
    readable = sum(ok for _, ok in RAGGED_PRECISIONS + ATTENTION_PRECISIONS)
    skipped = [entry for entry in report["skipped"] if entry["reason"].startswith("not rebuilt: precision")]
    assert len(report["entries"]) == readable, report["skipped"]
    assert set(kinds) <= {"flash_attention", "xla_ragged_dot"}
    assert len(skipped) == sum(not ok for _, ok in RAGGED_PRECISIONS + ATTENTION_PRECISIONS), report["skipped"]
    assert all("none of tokamax's forms" in s["reason"] or "neither" in s["reason"] for s in skipped)
