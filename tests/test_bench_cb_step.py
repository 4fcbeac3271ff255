"""The continuous-batching step benchmark's fast pieces: its sizes against flash_api's and transformers' own rules,
the gather's bytes against what transformers gathers, each path's terms adding up, and its table."""

from __future__ import annotations

import functools
import json
import re
import types

import jax.numpy as jnp
import pytest
import torch
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.cache_allocators.sliding_attention import (
    SlidingAttentionCacheAllocator)

from benchmarks.studies.cb_step import paths, programs, steps, summary
from benchmarks.studies.tables import cb_step as tables

from .conftest import REPO_ROOT

PADDING = REPO_ROOT / "kernel_repos" / "attention-tpu" / "torch-ext" / "attention_tpu" / "padding.py"
QWEN3, GPT_OSS, GEMMA4 = steps.MODELS
# Odd sizes: a decode row at a page boundary, one under the window, a chunk over cached rows, a fresh prefill.
SMALL = steps.Batch("small", "mixed", (1, 1, 7, 13), (257, 90, 300, 13))


def test_floors_and_rounding_are_flash_apis():
    source = PADDING.read_text()
    for name in ("RAGGED_SEQUENCES_FLOOR",):
        assert int(re.search(rf"^{name} = (\d+)$", source, re.M).group(1)) == getattr(steps, name)
    assert [steps.bucket(n) for n in (0, 1, 2, 3, 64, 65)] == [1, 1, 2, 4, 64, 128]
    assert steps.bucket(5, 16) == 16


def test_sizes_of_the_decode_step():
    decode, mixed = steps.batches()
    found = steps.sizes(decode, QWEN3)
    assert (found.sequences, found.total_q, found.total_k) == (64, 64, sum(decode.kv_lens))
    assert found.ragged_key_rows >= found.total_k > found.ragged_key_rows // 2
    assert (found.ragged_query_rows, found.ragged_sequences, found.ragged_max_q_len) == (64, 64, 1)
    assert (found.padded_batch, found.padded_query_rows, found.padded_key_rows) == (64, 1, 8192)
    with_chunk = steps.sizes(mixed, QWEN3)
    assert (with_chunk.sequences, with_chunk.total_q, with_chunk.padded_batch) == (65, 1088, 128)
    assert (with_chunk.ragged_query_rows, with_chunk.ragged_max_q_len, with_chunk.padded_query_rows) == (1536, 1024,
                                                                                                         1024)


def _transformers_read_index(batch: steps.Batch, model: steps.Model, page_size: int = 16) -> list[int]:
    """The read indices transformers' own allocators build for `batch`, each sequence on pages of its own."""
    index, next_page = [], 0
    for request, (q, kv) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        pages = -(-(kv if model.sliding_window is None else model.sliding_window) // page_size)
        stub = types.SimpleNamespace(block_table={request: list(range(next_page, next_page + pages))},
                                     tokens_per_page=page_size, block_physical_stride=page_size,
                                     sliding_window=model.sliding_window, sentinel_index=-1)
        next_page += pages
        if model.sliding_window is None:
            index += FullAttentionCacheAllocator.get_read_indices(stub, request, kv - q, q)
        else:
            stub._token_indices_to_physical_indices = functools.partial(
                SlidingAttentionCacheAllocator._token_indices_to_physical_indices, stub)
            index += SlidingAttentionCacheAllocator.get_read_indices(stub, request, kv - q, q)
    return index


@pytest.mark.parametrize("model", [QWEN3, GPT_OSS, GEMMA4], ids=lambda m: m.name)
def test_the_gather_moves_what_transformers_gathers(model):
    found = steps.sizes(SMALL, model)
    index = _transformers_read_index(SMALL, model)
    assert found.total_k == len(index) == len(steps.read_index(SMALL, model))
    cache = torch.randn(steps.cache_rows(SMALL, model), model.kv_heads, model.head_dim, dtype=torch.bfloat16)
    gathered = torch.index_select(cache, 0, torch.tensor(index).clamp(min=0))
    (select, *scatter) = programs.gather_programs(SMALL, model, found)
    assert programs.copied_bytes(select) == gathered.numel() * gathered.element_size()
    assert select.per_step == 2  # K and V
    assert len(scatter) == (model.sliding_window is not None)


def test_the_masked_scatter_puts_the_new_rows_at_the_sentinel_slots():
    index = steps.read_index(SMALL, GPT_OSS)
    gathered = jnp.arange(len(index) * 2, dtype=jnp.float32).reshape(len(index), 1, 2)
    new = -jnp.arange(1, SMALL.total_q * 2 + 1, dtype=jnp.float32).reshape(SMALL.total_q, 1, 2)
    out = programs.masked_scatter(gathered, jnp.asarray(index == -1), new)
    assert (out[index == -1] == new).all() and (out[index != -1] == gathered[index != -1]).all()


def test_the_ragged_pads_are_only_the_rows_past_the_data():
    found = steps.sizes(SMALL, QWEN3)
    pads = programs.ragged_pad_programs(QWEN3, found)
    assert [programs.copied_bytes(p) for p in pads] == [
        found.ragged_key_rows * QWEN3.kv_heads * QWEN3.head_dim * 2,
        found.ragged_query_rows * QWEN3.q_heads * QWEN3.head_dim * 2]
    exact = steps.Batch("exact", "decode", (1,) * 16, (8,) * 16)
    assert programs.ragged_pad_programs(QWEN3, steps.sizes(exact, QWEN3)) == []


def _term(name: str, us: float, calls: int = 2) -> dict:
    return {"term": name, "us_per_call": us / calls, "calls": calls, "us": us, "hbm_bytes_per_call": 100}


def test_a_paths_terms_add_up():
    copies = [_term("gather: K and V", 300.0), _term("pad: K and V", 200.0), _term("pad: q", 1.5, 1)]
    kernel = {"modelled_time_us": 250.0, "band_regime": "streaming", "bound": "hbm", "hbm_bytes": 10}
    found = paths.path(copies, kernel, "v5e")
    assert found["total_us"] == pytest.approx(751.5)
    assert (found["gather_us"], found["pad_us"], found["kernel_us"]) == (300.0, 201.5, 250.0)
    assert found["copies_share_pct"] == pytest.approx(100 * 501.5 / 751.5, abs=0.05)
    assert sum(t["us"] for t in found["terms"]) == pytest.approx(found["total_us"])
    assert found["copies_bytes"] == 500
    # XLA's copy of the kernel's arguments into its layout is a copy of the path, outside the kernel's band.
    relaid = paths.path(copies, {**kernel, "modelled_time_us": 290.0, "kernel_time_us": 250.0, "relayout_us": 40.0,
                                 "relayout_hbm_bytes": 64}, "v5e")
    assert (relaid["total_us"], relaid["relayout_us"], relaid["kernel_us"]) == (pytest.approx(791.5), 40.0, 250.0)
    assert relaid["copies_share_pct"] == pytest.approx(100 * 541.5 / 791.5, abs=0.05)
    assert relaid["copies_bytes"] == 564 and sum(t["us"] for t in relaid["terms"]) == pytest.approx(791.5)
    assert relaid["band_p90_us"][1] - relaid["total_us"] == pytest.approx(found["band_p90_us"][1] - 751.5, abs=0.02)
    assert paths.path([], {"error": "no"}, "v5e") == {"error": "no"}
    assert "error" in paths.path([{"term": "gather", "error": "OOM", "calls": 2, "us": 0}], kernel, "v5e")


def test_the_committed_results_add_up():
    data = json.loads((REPO_ROOT / "benchmarks" / "results" / "cb_step.json").read_text())
    for row in data["results"]:
        for generation, found in row["per_generation"].items():
            for name, figures in found.items():
                if "total_us" in figures:
                    # The JSON keeps five significant figures.
                    total = pytest.approx(figures["total_us"], rel=1e-4, abs=0.05)
                    assert sum(t["us"] for t in figures["terms"]) == total
                    parts = ("gather_us", "pad_us", "relayout_us", "kernel_us")
                    assert sum(figures[part] for part in parts) == total


def _data() -> dict:
    figures = {"total_us": 751.5, "band_p90_us": [700.0, 800.0], "gather_us": 300.0, "pad_us": 201.5,
               "kernel_us": 250.0, "copies_share_pct": 66.7}
    row = {"model": "Qwen3-30B-A3B", "step": "decode B=64", "per_generation": {
        g: {"transformers_ragged": {**figures, "terms": []}, "transformers_padded": {"error": "not replayed"},
            "ours_in_place": {**figures, "gather_us": 0.0, "pad_us": 0.0, "total_us": 250.0, "terms": []},
            "vllm_rpa_v3_in_place": {**figures, "total_us": 260.0, "band_p90_us": None, "terms": []}}
        for g in steps.GENERATIONS}}
    return {"summary": summary.summarise([row])}


def test_the_table_renders_every_case_and_path():
    data = _data()
    table = tables.render_markdown(data)["step"]
    lines = table.splitlines()
    assert len(lines) == 2 + len(steps.GENERATIONS)
    assert "| Qwen3-30B-A3B | decode B=64 | v5e | 752 (700-800) | 300 / 202 / 0 / 250 | 67 % | not priced | "\
           "250 (700-800) | 260 |" in lines
    assert data["summary"]["copies_dominate"] and len(data["summary"]["dominated"]) == len(steps.GENERATIONS)
    assert data["summary"]["transformers_ragged_over_in_place"] == {"min": 3.01, "max": 3.01}
