"""tpu_kernels.bench.multichip's collective model gives the numbers worked out by hand."""

import pytest


@pytest.fixture(scope="module")
def multichip():
    from tpu_kernels.bench import multichip

    return multichip


def test_all_reduce_of_a_batch_64_output_on_v6e_8(multichip):
    ici = multichip.Ici(link_bytes_per_s=1e11, hop_latency_s=1e-6)
    reduce = multichip.all_reduce("x", 64 * 2048 * 2, multichip.V6E_8, ici)
    # Ring: 2 x 7/8 x 262144 B over two directions of 1e11 B/s; latency 2 x 4 hops of 1 us.
    assert reduce.bandwidth_s == pytest.approx(2.29376e-6)
    assert reduce.latency_s == pytest.approx(8e-6)


def test_dispatch_layer_collectives_at_batch_64(multichip):
    ici = multichip.Ici(link_bytes_per_s=1e11, hop_latency_s=1e-6)
    listed = multichip.layer_collectives("ep_dispatch", 64, multichip.V6E_8, ici, host_sync_s=30e-6)
    by_name = {c.name: c for c in listed}
    # Counts: 16 local experts x 8 B per pair; 16 pairs cross the 2-link cut: 2048 B / 2e11 B/s, + 4 hops.
    assert by_name["per-expert counts all-to-all"].time_s == pytest.approx(4.01024e-6)
    # Picks: 8 tokens per chip x 8 picks / 8 chips = 8 rows of 4096 B per pair; 16 x 32768 B / 2e11 B/s + 4 us.
    assert by_name["picks out all-to-all"].time_s == pytest.approx(6.62144e-6)
    assert by_name["results back all-to-all"].time_s == pytest.approx(6.62144e-6)
    # All-gather of 262144 B: 7/8 of it over two directions, + 4 hops.
    assert by_name["output all-gather"].time_s == pytest.approx(5.14688e-6)
    assert sum(c.time_s for c in listed) == pytest.approx(62.69376e-6)


def test_tp_and_router_masking_issue_one_all_reduce_besides_attention(multichip):
    ici = multichip.Ici(link_bytes_per_s=1e11, hop_latency_s=1e-6)
    for mode in ("tp", "ep_router"):
        kinds = [c.kind for c in multichip.layer_collectives(mode, 8, multichip.V6E_8, ici, host_sync_s=30e-6)]
        assert kinds == ["all-reduce", "all-reduce"]
    with pytest.raises(ValueError, match="unknown mode"):
        multichip.layer_collectives("pipeline", 8, multichip.V6E_8, ici, host_sync_s=0.0)


def test_tp_shard_splits_the_intermediate_dim(multichip):
    setting = multichip.tp_setting()
    assert setting.model.intermediate == 96 and setting.local_experts == 128 and setting.ep == 1
