"""`python -m benchmarks report`'s tables of whole-step and padding studies, rendered from their JSON."""


def test_decode_step_tables_from_its_json():
    from benchmarks.studies.tables import decode_step as decode_step_tables

    def term(name: str, ms: float, kind: str = "uncalibrated") -> dict:
        return {"term": name, "ms_per_step": ms, "priced_by": "XLA program", "error_kind": kind}

    def path(terms: list[dict], ms: float, band: list[float]) -> dict:
        return {"terms": terms, "total": {"ms": ms, "band_ms": band}}

    append, router = term("cache append", 7.86), term("router", 0.02)
    ours = term("experts: ours", 4.66, "pallas_ragged_dot")
    paths = {"transformers_default": path([term("batched_mm: gather", 97.2), term("sdpa", 6.03), append, router],
                                          303.7, [303.5, 304.1]),
             "kernelized_experts": path([term("sdpa", 6.03), ours, append, router], 20.71, [20.3, 21.4]),
             "kernelized": path([term("flash", 5.01), ours, append, router, term("norm", 0.05)], 19.76, [18.3, 21.42])}
    ratio = {"modelled_ratio_band": [14.17, 16.62]}
    comparison = {"hf_measured_ratio": 21.5, "kernelized_experts": {**ratio, "modelled_ratio": 14.67},
                  "kernelized": {**ratio, "modelled_ratio": 15.37},
                  "kernelized_vs_hf": {"modelled_device_ms": 20.71, "hf_measured_ms": 56.6}}
    at = {"ms": {"transformers_default": 345.8, "kernelized_experts": 56.6, "kernelized": 52.5},
          "ratio": {"kernelized_experts": 6.11, "kernelized": 6.59}}
    eager = {name: {"other_ops": ops, "kernel_calls": calls} for name, ops, calls in (
        ("transformers_default", 4747, 0), ("kernelized_experts", 3739, 48), ("kernelized", 2437, 289))}
    eager.update(implied_op_cost_us={"serial": 8.859, "overlapped": 14.398},
                 with_implied_op_cost={"serial": at, "overlapped": at})
    model = {"model": {"name": "Qwen3-30B-A3B", "parameters_b": 30.53, "active_parameters_b": 3.35,
                       "source": "config.json"},
             "paths": paths, "comparison": comparison, "eager_host": eager,
             "without_cache_append": {"ratio": {"kernelized_experts": 23.0, "kernelized": 24.85}},
             "explanation": ["the gap is host time"],
             "hf_kernel_check": {"tokamax_default_us": 1687.4, "tokamax_default_grid_steps": 4608,
                                 "kernelized_step_with_it_ms": 97.0, "hf_measured_step_ms": 56.6,
                                 "grid_step_cost_bound_us": 0.1571, "grid_step_cost_bound_with_host_us": 0.1446}}
    method = {"context_tokens": 1024, "context_source": "assumed", "plan": "EP8", "cache": "dynamic",
              "priced": "compiled", "eager": "one op each", "errors": {"a": "p90 6 %"}, "error_note": "note",
              "left_out": "host time",
              "fitted_to": [{"assumption": "grid step", "value": "0.34 us", "fitted_to": "v5e's timings"}]}
    alone = {"grid_step_us": [4.1, 15.0], "hbm_share": [4.1, 4.9], "batched_mm_scale": [4.1, 12.5]}
    model["ratio_ranges"] = {
        "ranges": {"grid_step_us": [0.02, 0.34], "hbm_share": [0.78, 1.0], "batched_mm_scale": [1.0, 3.169]},
        "batched_mm_scale_from": "Qwen3's implied default",
        "paths": {"ours": {"step_ms": 20.71, "step_ms_range": [20.6, 26.4], "ratio": 19.1, "ratio_all": [19.1, 59.2],
                           "ratio_alone": alone},
                  "hf_kernel": {"step_ms": 97.05, "step_ms_range": [26.3, 103.1], "ratio": 4.07,
                                "ratio_all": [4.07, 48.3], "ratio_alone": alone}}}
    tables = decode_step_tables.render_markdown({"method": method, "models": {"qwen3-30b-a3b": model}})
    ranges_rows = tables["ratio-ranges"].splitlines()
    assert ranges_rows[0].startswith("| model | experts kernel in HF's configuration | device ms per step")
    assert "ratio, grid step 0.02-0.34 µs | ratio, HBM share 0.78-1.0 | ratio, batched_mm x1.0-3.169" in ranges_rows[0]
    assert ranges_rows[3] == ("| Qwen3-30B-A3B | HF's kernel (tokamax at its default tiles) | 97.0 (26.3-103.1) "
                              "| 4.1x | 4.1-15.0x | 4.1-4.9x | 4.1-12.5x | 4.1-48.3x | 56.6 ms / 21.5x |")
    assert tables["fitted-to"].splitlines()[2] == "| grid step | 0.34 us | v5e's timings |"
    assert tables["step"].splitlines()[2] == (
        "| Qwen3-30B-A3B | 303.7 (303.5-304.1) | 20.7 (20.3-21.4) | 19.8 (18.3-21.4) | 14.7x (14.2-16.6) | 21.5x "
        "| 15.4x (14.2-16.6) | 23.0x / 24.9x | 56.6 ms |")
    lines = tables["terms"].splitlines()
    assert lines[2].startswith("| Qwen3-30B-A3B | batched_mm: gather | 97.20 |  |  | XLA program |")
    assert lines[3].startswith("| Qwen3-30B-A3B | cache append | 7.86 | 7.86 | 7.86 |")
    assert lines[-1].startswith("| Qwen3-30B-A3B | 2 terms under 0.1 ms each") and "| 0.02 | 0.02 | 0.07 |" in lines[-1]
    assert tables["host"].splitlines()[3] == "| Qwen3-30B-A3B | kernelized_experts | 3739 + 48 | 56.6 / 56.6 | 6.1x / 6.1x |"
    assert "8.859 µs (host and device time add up) or 14.398 µs" in tables["host"]
    assert tables["gaps"].splitlines() == ["- **Qwen3-30B-A3B**", "  - the gap is host time."]
    assert tables["hf-kernel"].splitlines()[2] == "| Qwen3-30B-A3B | 1687 (4608) | 97.0 | 56.6 | 0.1571 (0.1446) |"
    assert "| context | 1024 tokens per request: assumed |" in tables["assumptions"]


def test_padding_table_from_its_json():
    from benchmarks.studies.tables import padding as padding_tables

    def bucket(size: int, real: int, pad: int, kernel: int) -> dict:
        return {"bucket": size, "real_bytes": real, "pad_copy_bytes": pad, "kernel_bytes": kernel,
                "pad_copy_seconds": {"v6e": pad * 1e-9}, "kernel_seconds": {"v6e": kernel * 1e-9}}

    data = {"models": {"m": {"entry_points": {"experts": [bucket(16, 100, 900, 1100), bucket(32, 1000, 1500, 500),
                                                          bucket(64, 1000, 600, 400)]}}}}
    assert padding_tables.render_markdown(data)["buckets"].splitlines()[2:] == [
        "| m | `experts` | 3: 16 to 64 | 20.0x | 2.00x | 64: 1.0 |"]
