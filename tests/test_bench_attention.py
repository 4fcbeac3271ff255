"""The attention benchmark's charge for XLA's relayout copies around the flash kernels: what a row says with and
without a probe, the card tables' relayout, and (aot) the flash kernel's forward and backward programs at head_dim
64, where XLA stores q, k, v and the output sequence-minor: the forward reads and writes them so (XLA copies
nothing, prefill or decode; a caller that keeps q row-major pays its copy), and so do the backward's kernels
(blocks of no multiple of 128 read row-major and XLA copies); at head_dim 128 every kernel reads its arguments as
given."""

import jax.numpy as jnp
import pytest

from benchmarks.studies.attention import backward, forward
from benchmarks.studies.relayouts import relayouts
from benchmarks.studies.tables import attention as tables
from tpu_kernels.distribution.loader import get_local_kernel
from benchmarks.perf import argument_layouts

# Small but real: S past 64 (XLA's default layout of [B, H, S, 64] puts S minor then), GQA.
SMALL_D64 = forward.Shape(label="small D=64", batch=2, q_len=256, kv_len=256, q_heads=4, kv_heads=2, head_dim=64)
# A chunk of 130 new queries over 300 keys: the last query block and the KV blocks past the arrays' ends.
SMALL_RAGGED_D64 = forward.Shape(label="small chunk D=64", batch=1, q_len=130, kv_len=300, q_heads=4, kv_heads=2,
                                 head_dim=64)
SMALL_DECODE_D64 = forward.Shape(label="small decode D=64", batch=2, q_len=1, kv_len=1000, q_heads=8, kv_heads=2,
                                 head_dim=64)
SMALL_D128 = forward.Shape(label="small D=128", batch=2, q_len=256, kv_len=256, q_heads=4, kv_heads=2, head_dim=128)
SMALL_TRAINING_D64 = backward.TrainingShape(label="small training D=64", batch=1, seq=256, q_heads=4, kv_heads=2,
                                            head_dim=64, sliding_window=128, sinks=True)
DTYPE = jnp.bfloat16


@pytest.fixture(scope="module")
def attention(kernel_builds):
    return get_local_kernel(kernel_builds["attention-tpu"], backend="cpu")


def _forward_row(attention, shape, generation, relayout):
    visible = forward.visible_work(attention.reference, shape, DTYPE)
    return forward.measure_generation(attention, shape, DTYPE, generation, visible, relayout)


def _bytes(shape: forward.Shape, heads: int, length: int) -> int:
    return shape.batch * heads * length * shape.head_dim * 2


@pytest.mark.slow
def test_a_row_not_probed_or_not_compiled_says_why_and_keeps_the_kernel_time(attention):
    unprobed = _forward_row(attention, SMALL_D64, "v6e", None)
    assert unprobed["relayout_us"] is None and "not probed" in unprobed["relayout_missing"]
    assert unprobed["modelled_time_us"] == unprobed["kernel_time_us"]
    failed = _forward_row(attention, SMALL_D64, "v6e", {"error": "VMEM OOM"})
    assert failed["relayout_us"] is None and "did not compile: VMEM OOM" in failed["relayout_missing"]
    assert failed["modelled_time_us"] == unprobed["modelled_time_us"]


@pytest.mark.aot
@pytest.mark.parametrize("generation", forward.GENERATIONS)
def test_the_flash_program_copies_neither_q_k_v_nor_out_at_head_dim_64_or_128(attention, generation):
    """[B, H, S, 64] arrives S-minor ({2,3,1,0}): the kernel reads q, K and V so and writes its output so, and XLA
    copies none of them (only the kernel's few scalar operands, staged into SMEM); at decode ([B, Hq, 1, 64]: no
    copy for a single position) nothing either. [B, H, S, 128] arrives row-major and is read as given."""
    for shape in (SMALL_D64, SMALL_RAGGED_D64):
        found = argument_layouts.probe(forward.kernel_fn(attention, shape, generation),
                                       forward.program_avals(shape, DTYPE), generation)
        assert [found.argument(number).minor_to_major for number in (0, 1, 2)] == [(2, 3, 1, 0)] * 3
        assert not any(found.argument(number).copies for number in (0, 1, 2)), shape.label
        assert found.copied_bytes < 1024 and not found.result_copies, shape.label
    decode = SMALL_DECODE_D64
    found = argument_layouts.probe(forward.kernel_fn(attention, decode, generation),
                                   forward.program_avals(decode, DTYPE), generation)
    assert [found.argument(number).minor_to_major[:2] for number in (1, 2)] == [(2, 3)] * 2
    assert found.copied_bytes < 1024 and not found.result_copies
    found = argument_layouts.probe(forward.kernel_fn(attention, SMALL_D128, generation),
                                   forward.program_avals(SMALL_D128, DTYPE), generation)
    assert all(found.argument(number).row_major and not found.argument(number).copies for number in (0, 1, 2))
    assert not found.result_copies


@pytest.mark.aot
def test_a_row_pays_the_relayout_its_probe_finds_in_its_time(attention):
    """A user's call in XLA's default layouts copies next to nothing at head_dim 64 and 128; a caller that keeps q
    row-major ([B, H, S, 64] pinned {3,2,1,0}) pays the copy of q into the layout the kernel reads."""
    for shape in (SMALL_D64, SMALL_D128):
        probe = relayouts(forward.kernel_fn(attention, shape, "v6e"), forward.program_avals(shape, DTYPE), "v6e")
        row = _forward_row(attention, shape, "v6e", probe)
        # Nothing but the kernel's few scalar operands (staged into SMEM) is copied.
        assert row["relayout_hbm_bytes"] < 1024 and row["relayout_us"] < tables.RELAYOUT_SHOWN_FROM_US, shape.label
        assert row["modelled_time_us"] == pytest.approx(row["kernel_time_us"] + row["relayout_us"])
    probe = argument_layouts.probe(forward.kernel_fn(attention, SMALL_D64, "v6e"),
                                   forward.program_avals(SMALL_D64, DTYPE), "v6e",
                                   major_to_minor=[(0, 1, 2, 3), None, None, None])  # q row-major
    pinned = _forward_row(attention, SMALL_D64, "v6e", probe)
    q_bytes = _bytes(SMALL_D64, SMALL_D64.q_heads, SMALL_D64.q_len)
    # q read and written once (at this size XLA stages the copy in VMEM).
    assert q_bytes <= pinned["relayout_hbm_bytes"] <= 2 * q_bytes + 1024
    assert any("{2,3,1,0}" in copy and "0.0 MiB" not in copy for copy in pinned["relayouts"])
    assert pinned["relayout_us"] > 0 and pinned["relayout_at_peak_bw_us"] <= pinned["relayout_us"]
    assert pinned["modelled_time_us"] == pytest.approx(pinned["kernel_time_us"] + pinned["relayout_us"])
    assert pinned["pct_of_roofline"] == pytest.approx(100 * pinned["roofline_us"] / pinned["modelled_time_us"])


@pytest.mark.aot
@pytest.mark.parametrize("generation", forward.GENERATIONS)
def test_the_backward_program_copies_neither_its_arguments_nor_its_gradients_at_head_dim_64(attention, generation):
    """The backward's kernels read d_out, q, k and v and write dq, dk and dv as XLA stores them at head_dim 64
    (sequence-minor; out only meets XLA's delta, which reads it as given): the pullback's program copies none of
    them (only the kernels' few scalar operands, staged into SMEM)."""
    found = argument_layouts.probe(backward.backward_fn(attention, SMALL_TRAINING_D64, generation),
                                   backward.backward_program_avals(SMALL_TRAINING_D64, DTYPE), generation)
    # d_out, q, k, v, out: arguments 0 to 4.
    assert not any(found.argument(number).copies for number in range(5))
    assert found.copied_bytes < 1024 and not found.result_copies


@pytest.mark.aot
def test_the_backward_total_pays_its_programs_relayout_and_the_kernels_times_do_not(attention):
    """Blocks that are the whole sequence and no multiple of 128 read row-major: the pullback's program copies
    d_out, q, k and v into the kernels' layout and dq, dk, dv back, the row's total pays that and its kernels'
    times do not; the forward at the same shape pays its own, so both sides of backward / forward carry theirs."""
    shape, generation = backward.TrainingShape(label="ragged training D=64", batch=1, seq=200, q_heads=4,
                                               kv_heads=2, head_dim=64, sliding_window=128, sinks=True), "v6e"
    whole = attention.AttentionConfig(shape.seq, shape.seq, 32 * 2**20)
    config = attention.flash_backward.tiles.BackwardConfig(dq=whole, dkv=whole)
    found = argument_layouts.probe(backward.backward_fn(attention, shape, generation, config),
                                   backward.backward_program_avals(shape, DTYPE), generation)
    plain = shape.as_shape()
    q_bytes, kv_bytes = _bytes(plain, shape.q_heads, shape.seq), _bytes(plain, shape.kv_heads, shape.seq)
    # d_out, q, k, v, out: arguments 0 to 4.
    assert [found.argument(n).copied_bytes for n in range(5)] == [q_bytes, q_bytes, kv_bytes, kv_bytes, 0]
    assert sorted(copy.bytes for copy in found.result_copies) == sorted([q_bytes, kv_bytes, kv_bytes])
    charged = backward.model_backward(attention, shape, DTYPE, generation, config, found)
    uncharged = backward.model_backward(attention, shape, DTYPE, generation, config)
    assert charged["relayout_us"] == pytest.approx(found.seconds() * 1e6) and charged["relayout_us"] > 0
    assert charged["total_modelled_us"] == pytest.approx(uncharged["total_modelled_us"] + charged["relayout_us"])
    assert charged["kernels"] == uncharged["kernels"] and "not probed" in uncharged["relayout_missing"]
    # The forward reads and writes q, K, V and out as XLA stores them: next to nothing is copied.
    forward_time = backward.forward_time(attention, shape, DTYPE, generation)
    assert 0 <= forward_time["forward_relayout_us"] < tables.RELAYOUT_SHOWN_FROM_US
    assert forward_time["forward_modelled_us"] == pytest.approx(forward_time["forward_kernel_us"]
                                                                + forward_time["forward_relayout_us"])


def _figures(us: float, relayout: float | None) -> dict:
    return {"bytes_ratio": 1.0, "band_p90_us": [0.8 * us, 1.2 * us], "modelled_time_us": us, "pct_of_roofline": 40.0,
            "bound": "hbm", "relayout_us": relayout}


def test_the_summary_names_the_shapes_whose_relayout_rounds_to_a_microsecond_or_more():
    def entry(label: str, us: float | None) -> dict:
        return {"label": label, "per_generation": {g: {"relayout_us": us} for g in forward.GENERATIONS}}

    found = forward.relayouts_shown([entry("d64", 61.38), entry("d128", 2e-5), entry("small", 0.3),
                                     entry("not probed", None)])
    assert found == {"d64": {g: 61.4 for g in forward.GENERATIONS}}


def test_the_forward_tables_show_the_relayout_where_a_row_has_one(monkeypatch):
    monkeypatch.setattr(tables, "FORWARD_SHAPES", {"d64": "D=64", "d128": "D=128"})
    monkeypatch.setattr(tables, "PER_GENERATION_SHAPES", {"d64": "D=64", "d128": "D=128"})
    monkeypatch.setattr(tables, "GENERATIONS", ("v6e",))
    results = [{"label": "d64", "per_generation": {"v5e": _figures(200.0, 120.0), "v6e": _figures(106.3, 61.4)}},
               {"label": "d128", "per_generation": {"v5e": _figures(88.0, 2e-5), "v6e": _figures(44.0, None)}}]
    assert tables.forward(results).splitlines()[2:] == [
        "| D=64 | 1.000, 1.000 | 106 µs (85–128; 40% of the HBM roofline; 61 µs of it XLA's relayout) |",
        "| D=128 | 1.000, 1.000 | 44 µs (35–53; 40% of the HBM roofline) |"]
    assert tables.per_generation(results).splitlines()[2:] == [
        "| D=64 | 106 µs (40 % of the HBM roofline; 61 µs of it XLA's relayout) |",
        "| D=128 | 44 µs (40 % of the HBM roofline) |"]


def test_the_backward_table_has_a_relayout_column_only_where_a_row_has_one(monkeypatch):
    monkeypatch.setattr(tables, "BACKWARD_SETTINGS", {"d64": "D=64", "d128": "D=128"})
    monkeypatch.setattr(tables, "BACKWARD_GENERATIONS", ("v6e",))
    kernel = {"block_q": 256, "block_kv": 256, "kv_heads_per_step": 4, "modelled_pipelined_time_us": 489.4,
              "pipelined_pct_of_roofline": 27.7}

    def entry(label: str, head_dim: int, relayout: float, forward_relayout: float) -> dict:
        figures = {"kernels": {"dq": kernel, "dkv": kernel}, "backward_over_forward": 0.9, "relayout_us": relayout,
                   "forward_relayout_us": forward_relayout}
        return {"label": label, "q_heads": 64, "kv_heads": 8, "head_dim": head_dim, "per_generation": {"v6e": figures}}

    run = {"summary": {"target_pct_of_roofline_per_kernel": 80.0},
           "results": [entry("d64", 64, 215.8, 169.3), entry("d128", 128, 1e-5, 0.0)]}
    assert tables.backward(run).splitlines() == [
        "| shape | gen | tiles (q, kv, KV heads/step) | dq | dk/dv | XLA's relayout (backward, forward) "
        "| backward / forward |", "|---|---|---|---|---|---|---|",
        "| D=64 (64/8 heads, D=64) | v6e | 256, 256, 4 | 489 µs, 28 % | 489 µs, 28 % | 216 µs, 169 µs | 0.9x |",
        "| D=128 (64/8 heads, D=128) | v6e | 256, 256, 4 | 489 µs, 28 % | 489 µs, 28 % | none | 0.9x |"]
    run["results"] = run["results"][1:]
    monkeypatch.setattr(tables, "BACKWARD_SETTINGS", {"d128": "D=128"})
    assert "relayout" not in tables.backward(run)


def test_the_useful_work_counts_each_sequence_of_a_batch_once(attention):
    """Visible (query, key) pairs are summed over the batch: the useful FLOPs, and with them the roofline, count each
    sequence's keys once (a batch counted twice put decode B=64 rows at twice their roofline)."""
    lengths = (37, 200, 256)
    shape = forward.qwen3_shape("decode B=3 cache=256", 3, 1, 256, kv_lengths=lengths)
    visible = forward.visible_work(attention.reference, shape, DTYPE)
    assert visible.pairs == sum(lengths)
    assert visible.useful_flops == 4 * shape.q_heads * sum(lengths) * shape.head_dim


def test_a_forward_shape_with_sinks_is_refused():
    with pytest.raises(ValueError, match="prices no attention sinks"):
        forward.Shape(label="sinks", batch=1, q_len=8, kv_len=8, q_heads=4, kv_heads=2, head_dim=64, sinks=True)
