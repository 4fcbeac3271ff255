"""The collective model (benchmarks.perf.collectives) and the multichip benchmark's use of it.

Bytes are checked against counts made by hand; times by the properties the
formulas must have (units, what grows with what), not by pinned figures.
"""

import dataclasses

import pytest

from benchmarks.perf import collectives
from benchmarks.perf.collectives import Ici, Mesh

ICI = Ici(link_bytes_per_s=1e11, hop_latency_s=1e-6)
MESHES = [Mesh(1, 2), Mesh(2, 2), Mesh(2, 4), Mesh(4, 4), Mesh(4, 8)]
# Qwen3-30B-A3B: hidden 2048, 128 experts, top-8.
QWEN = dict(hidden=2048, experts=128, top_k=8)


def by_name(mode, batch, mesh=collectives.V6E_8, ici=ICI, host_sync_s=30e-6):
    listed = collectives.moe_layer_collectives(mode, batch, mesh=mesh, ici=ici, host_sync_s=host_sync_s, **QWEN)
    return {c.name: c for c in listed}


def test_the_v6e_8_mesh_is_2x4_without_wraparound():
    mesh = collectives.V6E_8
    assert (mesh.rows, mesh.cols, mesh.chips) == (2, 4, 8)
    assert mesh.diameter == 4  # corner to corner: 1 + 3 hops
    assert mesh.bisection_links == 2  # the cut between columns 2 and 3 crosses one link per row


def test_collective_bytes_are_the_hand_counts():
    """Decode at batch 64 on a v6e-8, bf16: the arrays and per-pair messages each collective moves."""
    found = by_name("ep_dispatch", 64)
    output = 64 * 2048 * 2  # B x H bf16
    assert found["output all-gather"].bytes == output == 262_144
    assert found["attention o_proj all-reduce"].bytes == output
    assert found["per-expert counts all-to-all"].bytes == 16 * 8  # 128 / 8 local experts, int64 counts
    # 64 / 8 = 8 tokens per chip, 8 picks each, spread over 8 chips: 8 rows of 2048 bf16 per ordered pair.
    assert found["picks out all-to-all"].bytes == found["results back all-to-all"].bytes == 8 * 2048 * 2
    assert found["split sizes to the host (.tolist())"].bytes == 0
    tp = by_name("tp", 64)
    assert [c.bytes for c in tp.values()] == [output, output]


def test_times_are_latency_plus_bytes_over_bandwidth_in_seconds():
    """A collective over twice the bytes costs exactly one more bytes term; latency is whole hops of the mesh."""
    for make in (collectives.all_reduce, collectives.all_gather, collectives.all_to_all):
        small, large = make("x", 1 << 16, collectives.V6E_8, ICI), make("x", 1 << 17, collectives.V6E_8, ICI)
        assert large.bandwidth_s == pytest.approx(2 * small.bandwidth_s) and large.latency_s == small.latency_s
        assert small.time_s == pytest.approx(small.bandwidth_s + small.latency_s)
        # Seconds: 64 KiB over 1e11 B/s links is microseconds, not milliseconds or nanoseconds.
        assert 1e-7 < small.bandwidth_s < 1e-5
        hops = small.latency_s / ICI.hop_latency_s
        assert hops == pytest.approx(round(hops)) and round(hops) % collectives.V6E_8.diameter == 0
        assert make("x", 0, collectives.V6E_8, ICI).bandwidth_s == 0
    # An all-reduce is a reduce-scatter and an all-gather: twice an all-gather's bytes term and hops.
    reduce = collectives.all_reduce("x", 1 << 20, collectives.V6E_8, ICI)
    gather = collectives.all_gather("x", 1 << 20, collectives.V6E_8, ICI)
    assert reduce.bandwidth_s == pytest.approx(2 * gather.bandwidth_s) and reduce.latency_s == 2 * gather.latency_s
    # The ring moves (N-1)/N of the array over both directions of a link: under S / W, over S / (2 W).
    assert (1 << 20) / (2 * 1e11) < reduce.bandwidth_s < 2 * (1 << 20) / 1e11


def test_faster_links_and_shorter_hops_never_cost_more():
    fast = Ici(link_bytes_per_s=2e11, hop_latency_s=0.5e-6)
    for make in (collectives.all_reduce, collectives.all_gather, collectives.all_to_all):
        slow_time = make("x", 1 << 20, collectives.V6E_8, ICI)
        fast_time = make("x", 1 << 20, collectives.V6E_8, fast)
        assert fast_time.bandwidth_s == pytest.approx(slow_time.bandwidth_s / 2)
        assert fast_time.latency_s == pytest.approx(slow_time.latency_s / 2)


def test_more_chips_cost_more_hops_and_all_to_all_crosses_a_wider_cut():
    for smaller, larger in zip(MESHES, MESHES[1:]):
        for make in (collectives.all_reduce, collectives.all_gather, collectives.all_to_all):
            assert make("x", 1 << 20, larger, ICI).latency_s >= make("x", 1 << 20, smaller, ICI).latency_s
        # Ring collectives: the share of the array that moves, (N-1)/N, grows with N.
        assert (collectives.all_gather("x", 1 << 20, larger, ICI).bandwidth_s
                >= collectives.all_gather("x", 1 << 20, smaller, ICI).bandwidth_s)
        # All-to-all of a fixed message per pair: (N/2)^2 pairs cross the cut, which has only `rows` links.
        assert (collectives.all_to_all("x", 4096, larger, ICI).bandwidth_s
                > collectives.all_to_all("x", 4096, smaller, ICI).bandwidth_s)


def test_collectives_grow_with_the_batch_and_dispatch_costs_more_than_one_all_reduce():
    for mode in collectives.MOE_MODES:
        totals = [sum(c.time_s for c in by_name(mode, batch).values()) for batch in (1, 8, 64, 256, 2048)]
        assert totals == sorted(totals) and totals[-1] > totals[0]
    for batch in (1, 8, 64, 256):
        tp, router, dispatch = (sum(c.time_s for c in by_name(m, batch).values()) for m in collectives.MOE_MODES)
        assert tp == router < dispatch
    # The host sync is its own term: it adds exactly its seconds to the dispatch layer.
    with_sync = sum(c.time_s for c in by_name("ep_dispatch", 64, host_sync_s=100e-6).values())
    without = sum(c.time_s for c in by_name("ep_dispatch", 64, host_sync_s=0.0).values())
    assert with_sync - without == pytest.approx(100e-6)


def test_tp_and_router_masking_issue_one_all_reduce_besides_attention():
    for mode in ("tp", "ep_router"):
        kinds = [c.kind for c in by_name(mode, 8).values()]
        assert kinds == ["all-reduce", "all-reduce"]
    assert [c.kind for c in by_name("ep_dispatch", 8).values()] == [
        "all-to-all", "host sync", "all-to-all", "all-to-all", "all-gather", "all-reduce"]
    with pytest.raises(ValueError, match="unknown mode"):
        by_name("pipeline", 8)


def test_the_benchmark_prices_qwen3_on_the_model_from_perf():
    from benchmarks.studies import multichip

    assert multichip.Collective is collectives.Collective and multichip.V6E_8 is collectives.V6E_8
    assert (multichip.MODEL.hidden, multichip.MODEL.experts, multichip.MODEL.top_k) == tuple(QWEN.values())
    listed = multichip.layer_collectives("ep_dispatch", 64, multichip.V6E_8, ICI, host_sync_s=30e-6)
    assert [dataclasses.astuple(c) for c in listed] == [dataclasses.astuple(c) for c in by_name("ep_dispatch", 64).values()]


def test_tp_shard_splits_the_intermediate_dim():
    from benchmarks.studies import multichip

    setting = multichip.tp_setting()
    assert setting.model.intermediate == 96 and setting.local_experts == 128 and setting.ep == 1


def test_fused_ep_moe_exchanges_the_hand_counts():
    """vLLM's fused kernel at batch 64 on a v6e-8 in token blocks of 4: 2 blocks of the chip's 8 tokens; per block
    7 ring steps of the 128 padded int32 counts, 7 + 1 + 16 + 2 barriers, rows out and back of 4 x 8 / 8 picks per
    ordered pair (hidden padded to 256); one barrier at the start; the layer's output all-gather and attention's
    all-reduce."""
    listed = collectives.fused_ep_moe_collectives(64, token_block=4, mesh=collectives.V6E_8, ici=ICI, **QWEN)
    found = {c.kind + (" back" if "back" in c.name else ""): c for c in listed}
    assert found["barrier"].name == "kernel barrier x 53"
    assert found["barrier"].latency_s == pytest.approx(53 * 4 * 1e-6) and found["barrier"].bandwidth_s == 0
    assert found["neighbour copy"].name == "pick counts ring step x 14" and found["neighbour copy"].bytes == 512
    assert found["neighbour copy"].time_s == pytest.approx(14 * (1e-6 + 512 / 1e11))
    assert found["all-to-all"].bytes == found["all-to-all back"].bytes == 4 * 2048 * 2
    one = collectives.all_to_all("one", 4 * 2048 * 2, collectives.V6E_8, ICI)
    assert found["all-to-all back"].time_s == pytest.approx(2 * one.time_s)
    assert found["all-gather"].bytes == found["all-reduce"].bytes == 64 * 2048 * 2
    # A hidden size off the 256 grid moves vLLM's padded rows; fewer, larger token blocks issue fewer barriers.
    odd = collectives.fused_ep_moe_collectives(64, token_block=8, mesh=collectives.V6E_8, ici=ICI,
                                               **{**QWEN, "hidden": 2880})
    assert {c.kind: c for c in odd}["all-to-all"].bytes == 8 * 3072 * 2
    assert {c.kind: c for c in odd}["barrier"].name == "kernel barrier x 27"
