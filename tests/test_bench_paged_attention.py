"""The paged attention benchmark's fast pieces: the roofline's bytes and FLOPs, the summary's targets and rival
comparisons, and the card tables rendered from its JSON."""

import pytest

from benchmarks.studies.paged_attention import shapes, summary
from benchmarks.studies.tables import paged_attention as tables

QWEN3 = shapes.MODELS[0]
GPT_OSS = shapes.MODELS[1]


def test_minimum_bytes_read_each_visible_key_once_and_q_and_out_once():
    batch = shapes.Batch("b", "decode", (1, 1), (100, 7))
    per_token = 2 * QWEN3.kv_heads * QWEN3.head_dim * 2  # K and V rows, bf16
    q_and_out = 2 * 2 * QWEN3.q_heads * QWEN3.head_dim * 2
    assert shapes.minimum_bytes(batch, QWEN3) == 107 * per_token + q_and_out


def test_a_window_bounds_the_keys_and_pairs_of_a_prefill_chunk():
    batch = shapes.Batch("b", "mixed", (3, 1), (200, 50))
    window = GPT_OSS.sliding_window
    # Queries at 197, 198, 199 see [max(0, p - window + 1), p]: window keys each, 130 distinct keys; decode: window.
    assert shapes.visible_keys(batch, GPT_OSS) == [(window + 2, 3 * window), (50, 50)]
    assert shapes.useful_flops(batch, GPT_OSS) == 4 * (3 * window + 50) * GPT_OSS.q_heads * GPT_OSS.head_dim


def test_the_mixed_length_batch_is_fixed_and_in_range():
    first, again = shapes.decode_batches()[0], shapes.decode_batches()[0]
    assert first == again and len(first.kv_lens) == shapes.DECODE_BATCH
    assert all(shapes.MIXED_RANGE[0] <= n <= shapes.MIXED_RANGE[1] for n in first.kv_lens)
    mixed = shapes.mixed_batch()
    assert mixed.q_lens[0] == shapes.PREFILL_CHUNK and mixed.total_q == shapes.PREFILL_CHUNK + shapes.DECODE_BATCH


def _figures(pct, time_us, *, bound="hbm", hbm=10.0, mxu=1.0, vector=2.0):
    return {"pct_of_hbm_roofline_peak": pct, "pct_of_mxu_peak": pct / 10, "modelled_time_us": time_us,
            "bound": bound, "hbm_term_us": hbm, "mxu_us": mxu, "vector_us": vector, "step_overhead_us": 0.5,
            "hbm_roofline_us": time_us * pct / 100, "band_p90_us": None, "bytes_ratio": 1.93}


def _row(context, kind="decode", page=128, ours=90.0, rival_time=None, rival_error=None):
    per = {g: _figures(ours, 100.0) for g in shapes.GENERATIONS}
    rival = {"error": "decode only (one query per sequence)"}
    if rival_time is not None:
        rival = {"per_generation": {g: _figures(95.0, rival_time, vector=0.5) for g in shapes.GENERATIONS}}
    if rival_error is not None:
        rival = {"per_generation": {g: {"config": {}, "error": rival_error} for g in shapes.GENERATIONS}}
    label = f"decode length {context}" if context else ("mixed" if kind == "mixed" else "decode lengths")
    return {"model": "M", "batch": label, "kind": kind, "context": context, "page_size": page,
            "ours": per, "rivals": {"jax_paged_attention": rival, "vllm_rpa_v3": {"error": "no attention sinks"}}}


def test_summary_names_each_miss_from_1024_tokens_and_its_terms():
    rows = [_row(256, ours=50.0), _row(1024, ours=80.0), _row(4096, ours=90.0)]
    found = summary.summarise(rows)
    assert not found["meets_decode_target"]
    assert {(m["where"].split(" | ")[1], m["generation"]) for m in found["decode_target_misses"]} == {
        ("decode length 1024", g) for g in shapes.GENERATIONS}
    miss = found["decode_target_misses"][0]
    assert (miss["bound"], miss["hbm_term_us"], miss["vector_us"]) == ("hbm", 10.0, 2.0)
    # 80 % of the roofline in 100 us: 94.1 us would be 85 %; the grid steps and the rest not overlapped named.
    assert (miss["modelled_time_us"], miss["time_for_target_us"], miss["step_overhead_us"]) == (100.0, 94.1, 0.5)
    assert "+ 0.5 grid steps + 89.5 not overlapped" in miss["why"]
    # The bytes moved over the minimum are named: a miss of the streaming kind says whether it reads too much.
    assert miss["bytes_over_min"] == 1.93 and "copies (10.0, 1.93x the minimum bytes)" in miss["why"]
    assert found["no_rival_faster"]


def test_summary_says_by_how_much_a_rival_is_faster_and_which_term_differs():
    found = summary.summarise([_row(4096, rival_time=80.0), _row(8192, rival_error="not counted")])
    assert not found["no_rival_faster"]
    faster = found["rivals_faster"]
    assert {f["generation"] for f in faster} == set(shapes.GENERATIONS)
    assert faster[0]["ours_over_rival"] == 1.25 and faster[0]["material"]
    assert "largest gap vector_us 2.0 vs 0.5" in faster[0]["why"]
    assert found["rivals_materially_faster"] == len(faster)


def test_card_tables_from_the_json():
    rows = [_row(None, page=16), _row(None), _row(4096, rival_time=80.0), _row(None, kind="mixed",
                                                                              rival_error="not counted")]
    rendered = tables.render_markdown({"results": rows})
    assert set(rendered) == {"decode", "context", "mixed", "rivals"}
    assert rendered["decode"].splitlines()[2] == "| M | 16 | " + " | ".join(
        ["90 % (100 µs, HBM)"] * 3) + " |"
    assert rendered["context"].splitlines()[2] == "| M | 4096 | 90 % | 90 % | 90 % |"
    assert rendered["mixed"].splitlines()[2] == "| M | " + " | ".join(["9 % MXU, 90 % HBM (100 µs)"] * 3) + " |"
    rivals = rendered["rivals"].splitlines()
    # Page 128 only: the mixed-length decode (rival n/a), the 4096 point (priced) and the mixed batch (not priced).
    assert len(rivals) == 2 + 3 * 3
    assert "| M | decode length 4096 | v5e | 100 | 80 | n/a | n/a |" in rivals
    assert "| M | mixed | tpu7x | 100 | not priced | n/a | n/a |" in rivals


def test_the_rivals_table_shows_rpa_v3_at_vllms_default_beside_its_best():
    row = _row(4096)
    defaults = {"v5e": {"modelled_time_us": 101.4}, "v6e": {"modelled_time_us": 90.0, "error": "does not fit"},
                "tpu7x": {"error": "ValueError: refused"}}
    row["rivals"]["vllm_rpa_v3"] = {"per_generation": {
        g: {**_figures(95.0, 80.0), "vllm_default": {"config": {}, **defaults[g]}} for g in shapes.GENERATIONS}}
    rivals = tables.render_markdown({"results": [row]})["rivals"].splitlines()
    assert rivals[0].endswith("| vLLM RPA v3 | vLLM RPA v3 at vLLM's default |")
    assert rivals[2:] == [f"| M | decode length 4096 | {g} | 100 | n/a | 80 | {cell} |"
                          for g, cell in zip(shapes.GENERATIONS, ("101", "not priced", "not priced"))]


def test_a_row_without_a_generation_is_a_key_error():
    row = _row(None)
    del row["ours"]["tpu7x"]
    with pytest.raises(KeyError):
        tables.decode([row])


def test_the_replay_counts_small_tiles_for_decode_rows_and_large_ones_for_a_long_chunk(kernel_builds):
    """The priced replay of our kernel: Qwen3-30B-A3B decode rows (group 8, bfloat16) run 16-row matmuls, a ragged
    1000-token chunk 256-row ones (small tiles would save too few rows), each decode row once per key block."""
    import numpy as np

    from benchmarks import perf
    from benchmarks.studies.paged_attention import ours
    from tpu_kernels.distribution.loader import get_local_kernel

    built = get_local_kernel(kernel_builds["attention-tpu"], backend="cpu")
    batch = shapes.Batch("b", "mixed", (1000, 1, 1, 1), (1000, 300, 700, 1500))
    calls = perf.model_pallas_traffic(ours.kernel_fn(built, batch, QWEN3, "v6e"), *ours.paged_inputs(batch, QWEN3, 128))
    counts = {}
    for call in calls:
        for key, per_phase in call.phases.work.items():
            if len(key) > 1:  # a matmul's (batch, m, k, n, ...) shape
                counts[key[1]] = counts.get(key[1], 0) + int(np.sum(per_phase))
    block_kv = ours.tiles(built, batch, QWEN3, 128, "v6e").block_kv
    decode_blocks = sum(-(-n // block_kv) for n in batch.kv_lens[1:])
    assert set(counts) == {16, 256}
    assert counts[16] == 2 * QWEN3.kv_heads * decode_blocks  # QK and PV per KV head and block


def test_a_relayout_is_charged_at_its_bytes_or_the_row_says_why_not():
    from benchmarks.studies import relayouts
    from benchmarks.perf import argument_layouts

    copy = argument_layouts.Copy("copy.1", "copy", (3, 2, 1, 0), "hbm", 1 << 30, 2 << 30)
    cache = argument_layouts.ArgumentLayout(1, "k_cache", "bf16", (8192, 128, 8, 64), (1, 3, 2, 0), (copy,))
    probe = argument_layouts.LayoutProbe("v6e", (cache,), ())
    found = relayouts.relayout_fields(probe)
    assert found["relayout_us"] == pytest.approx(probe.seconds() * 1e6) and found["relayout_hbm_bytes"] == 2 << 30
    assert found["relayout_at_peak_bw_us"] <= found["relayout_us"] and found["relayouts"] == [copy.describe()]
    missing = relayouts.relayout_fields({"error": "VMEM OOM"})
    assert missing["relayout_us"] is None and "did not compile: VMEM OOM" in missing["relayout_missing"]
    assert relayouts.relayout_fields(None) == {"relayout_us": None, "relayout_missing": relayouts.NOT_PROBED}


def test_the_cases_are_measured_in_order_and_kept_as_they_come(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from benchmarks.studies.paged_attention import run

    monkeypatch.setattr(run, "_start_worker", lambda repo, wheels, rivals_from: None)
    monkeypatch.setattr(run, "measure_case", lambda case: {"case": case})
    args = SimpleNamespace(jobs=1, repo=None, wheels=None, out=tmp_path / "paged.json", rivals_from=None)
    assert run._measure(["a", "b", "c"], args) == [{"case": "a"}, {"case": "b"}, {"case": "c"}]
    assert (tmp_path / "paged.partial.json").exists()
    with pytest.raises(SystemExit):
        run.main(["--jobs", "0"])


def test_window_rings_and_varlen_keys_hold_the_keys_a_decode_row_sees():
    """A ring (and the varlen keys transformers gathers from it) holds a sequence's window, a prefill chunk's
    varlen keys its new ones and the window's before them; the rivals' call over pages reads those keys, and
    varlen keys are packed on one page of whole 128-row tiles, each sequence's first row in the page table."""
    from benchmarks.studies.paged_attention import ours, shapes

    by_name = {model.name: model for model in shapes.MODELS}
    ring, varlen = by_name["GPT-OSS-20B sliding, window rings"], by_name["GPT-OSS-20B sliding, varlen keys"]
    batch = shapes.Batch("b", "mixed", (1, 1, 300), (50, 1000, 2000))
    assert [varlen.keys_held(q, n) for q, n in zip(batch.q_lens, batch.kv_lens)] == [50, 128, 427]
    assert ring.pages_per_seq(batch, 256) == 1 and by_name["GPT-OSS-20B sliding"].pages_per_seq(batch, 256) == 8
    read_batch, read_model = ring.read_as(batch)
    assert read_batch.kv_lens == (50, 128, 427) and read_model.cache == "pages" and read_model.sliding_window == 128
    q, k, _, cu_q, kv_lens, table, _ = ours.paged_inputs(batch, varlen, 128)
    assert k.shape == (1, 640, 8, 64) and list(kv_lens) == [50, 128, 427] and table[:, 0].tolist() == [0, 50, 178]
    assert shapes.minimum_bytes(batch, ring) == shapes.minimum_bytes(read_batch, read_model)
    with pytest.raises(ValueError, match="cache must be one of"):
        shapes.Model(q_heads=8, kv_heads=1, head_dim=64, name="no window", cache="window rings")
