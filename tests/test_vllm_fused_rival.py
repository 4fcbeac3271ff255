"""moe_layer's rival vllm_fused_ep_moe: vLLM's fused MoE kernel loaded from the pinned wheel, fed the layer's
arrays as vLLM's layer arranges them, its block sizes and counted schedule, and its rows."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.studies.moe_layer import shapes, vllm_fused, vllm_kernels

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = shapes.MODELS["qwen3-30b-a3b"]
EP8_DISPATCH = next(s for s in shapes.SETTINGS if s.label == "qwen3-30b-a3b EP8 dispatch")


@pytest.fixture(scope="module")
def fused_moe():
    return vllm_kernels.load_fused_moe(vllm_kernels.DEFAULT_FOLDER)


def test_the_fused_kernel_loads_from_the_pinned_wheel_beside_the_gmm(fused_moe):
    """Both kernels run as modules of the wheel's own names under the same stand-in packages."""
    assert fused_moe.__file__ == f"{vllm_kernels.WHEEL_NAME}/tpu_inference/kernels/fused_moe/v1/kernel.py"
    assert callable(fused_moe.fused_ep_moe)
    gmm = vllm_kernels.load_gmm(vllm_kernels.DEFAULT_FOLDER)
    assert gmm.__module__ == "tpu_inference.kernels.megablox.gmm"
    assert vllm_kernels.load_fused_moe(vllm_kernels.DEFAULT_FOLDER) is fused_moe


@pytest.mark.slow
def test_the_arrays_given_the_kernel_make_the_experts_layer(fused_moe, tmp_path):
    """What the benchmark feeds vLLM (w13 [E, 2, H, I] from transformers' gate_up [E, 2I, H], w2 [E, I, H], logits
    whose softmax top-k, renormalised, is the routing) makes the experts layer: vLLM's own reference on them
    matches our float64 reference at that routing."""
    import torch

    from tpu_kernels.distribution.builder import build_kernel_repo
    from tpu_kernels.distribution.loader import get_local_kernel

    reference = get_local_kernel(build_kernel_repo(ROOT / "kernel_repos" / "ragged-dot-tpu", tmp_path),
                                 backend="cpu").reference
    tokens, hidden, intermediate, experts, top_k = 5, 256, 128, 6, 3
    rng = np.random.default_rng(1)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    gate_up = (0.2 * rng.standard_normal((experts, 2 * intermediate, hidden))).astype(np.float32)
    down = (0.2 * rng.standard_normal((experts, hidden, intermediate))).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    w13 = np.stack([gate_up[:, :intermediate], gate_up[:, intermediate:]], axis=1).swapaxes(2, 3)
    w2 = down.swapaxes(1, 2)
    out = np.asarray(fused_moe.ref_moe(jnp.asarray(x), jnp.asarray(w13), jnp.asarray(w2), jnp.asarray(logits), top_k,
                                       renormalize_topk_logits=True, act_fn=vllm_fused.ACTIVATIONS["silu"]))
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    weights, index = jax.lax.top_k(probs, top_k)
    weights = weights / weights.sum(-1, keepdims=True)
    expected = reference.gated_experts_reference(
        *map(torch.from_numpy, (x, np.array(index, np.int32), np.array(weights), gate_up, down)),
        activation="silu", weights_transposed=False).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.slow
def test_the_kernel_cannot_run_in_pallas_tpu_interpret_mode(fused_moe):
    """Why its output is not checked on the CPU: jax 0.10.2's TPU interpreter reads refs through indexers only,
    and the kernel reads its token buffers through `ref.bitcast(uint32).reshape(...)`. When this passes no
    more, compare the kernel's output with the reference here."""
    from jax.experimental.pallas import tpu as pltpu

    tokens, hidden, intermediate, experts, top_k = 16, 512, 256, 4, 2
    keys = jax.random.split(jax.random.key(0), 4)
    args = (jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16),
            jax.random.normal(keys[1], (experts, 2, hidden, intermediate), jnp.bfloat16),
            jax.random.normal(keys[2], (experts, intermediate, hidden), jnp.bfloat16),
            jax.random.normal(keys[3], (tokens, experts), jnp.bfloat16))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(Exception, match="'BitcastTransform' object has no attribute 'indices'"):
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            jax.block_until_ready(fused_moe.fused_ep_moe(mesh, *args, top_k=top_k))


@pytest.mark.parametrize("tokens, ep, expected", [
    # Qwen3 is not in vLLM's tuned table: its default formula, then the kernel's overrides (small token counts
    # are one block; no block exceeds the rank's tokens).
    (256, 8, {"bt": 32, "bf": 384, "bd1": 1024, "bd2": 1024, "btc": 16, "bfc": 384, "bd1c": 1024, "bd2c": 1024}),
    (64, 8, {"bt": 8, "btc": 8}),
    (8192, 1, {"bt": 128, "btc": 64}),
])
def test_block_sizes_are_vllms_own_pick(tokens, ep, expected):
    sizes, source = vllm_fused.block_sizes(QWEN3, tokens, ep)
    assert source.startswith("default formula")
    assert {name: sizes[name] for name in expected} == expected


def test_the_counted_schedule_is_the_busiest_ranks_work():
    """At the EP8 anchor the rank computes the busiest rank's picks (the dispatch case's rows), reads all 16 local
    experts' weights once per token block (every expert, with rows or not), and its matmuls cover those rows in
    btc-row chunks; the rows it exchanges with other ranks are counted, not priced."""
    case = shapes.make_case(EP8_DISPATCH, 256)
    replayed, facts = vllm_fused.replay(case)
    (call,) = replayed.pallas_calls
    assert facts["expert_rows"] == case.live_picks and facts["token_blocks"] == 1
    weights = {op.origin: op.hbm_bytes for op in call.operands}
    h, i = QWEN3.hidden, QWEN3.intermediate
    assert weights["w13"] + weights["w2"] == 16 * 3 * h * i * 2
    own = 256 // 8 * QWEN3.top_k  # the rank's 32 tokens' picks, read out and gathered back
    assert weights["tokens"] == own * h * 2 and weights["gathered"] == 2 * own * h * 2
    assert weights["output"] == 32 * h * 2
    mxu_rows = sum(dot.count * dot.m * dot.k * dot.n for dot in call.dots) / (3 * h * i)
    assert case.live_picks <= mxu_rows < case.live_picks + 16 * facts["block_sizes"]["btc"]
    assert facts["remote_rows"] > 0 and "not priced here" in facts["not_priced"]
    assert not call.unmodelled_dmas


def test_a_shape_the_kernel_refuses_is_a_row_with_its_reason(tmp_path):
    """One token over eight ranks: the kernel's own ValueError is the row's error, not a dropped rival."""
    from benchmarks.studies.moe_layer.cache import Cache, Compiler
    from benchmarks.studies.moe_layer.measure import queue_fused, variant

    case = shapes.make_case(EP8_DISPATCH, 1)
    compiler = Compiler(Cache(tmp_path), 1)
    pending = {}
    queue_fused(case, compiler, ("v6e",), pending)
    future, sizes, found = pending[(vllm_fused.FUSED, "v6e")]
    entry = variant(None, case, compiler, vllm_fused.FUSED, "v6e", future.result(), sizes, found, None)
    compiler.pool.shutdown()
    assert entry["compiled"] is False and "aligned to ep_size=8" in entry["error"]
    assert entry["configs_searched"] == 0 and entry["refused_block_sizes"] == []


def test_every_generation_has_a_mesh_of_each_ep_rank_count():
    """The rival runs wherever ours does: each supported generation has a compile-only mesh of one rank and of every
    EP setting's rank count, of distinct devices (on TPU7x a rank is one of a chip's two cores)."""
    from tpu_kernels.runtime.hardware import SUPPORTED_GENERATIONS

    for generation in SUPPORTED_GENERATIONS:
        for ep in sorted({1} | {setting.ep for setting in shapes.SETTINGS}):
            mesh = vllm_fused.mesh_for(generation, ep)
            assert mesh.shape == {"data": 1, "model": ep}
            assert len({device.id for device in mesh.devices.flat}) == ep
            assert mesh.devices.flat[0].platform == "tpu"
    with pytest.raises(ValueError, match="no compile-only topology of 16 v6e chips"):
        vllm_fused.mesh_for("v6e", 16)


@pytest.mark.aot
@pytest.mark.parametrize("generation", ["v6e", "v5p", "tpu7x"])
def test_an_ep8_row_is_compiled_with_its_body_and_says_what_it_leaves_out(tmp_path, generation):
    """Qwen3's EP8 rank at 64 tokens: compiled at its searched block sizes on an eight-rank compile-only mesh
    (v5p's megacore chips, TPU7x's cores), priced no slower than vLLM's own pick, and its JSON line carries both
    picks and the reason its cross-device part is not priced."""
    from benchmarks.studies.moe_layer.cache import Cache, Compiler
    from benchmarks.studies.moe_layer.measure import queue_fused, row_facts, variant
    from benchmarks.studies.moe_layer.report import variant_lines

    case = shapes.make_case(EP8_DISPATCH, 64)
    compiler = Compiler(Cache(tmp_path), 1)
    pending = {}
    queue_fused(case, compiler, (generation,), pending)
    future, sizes, found = pending[(vllm_fused.FUSED, generation)]
    entry = variant(None, case, compiler, vllm_fused.FUSED, generation, future.result(), sizes, found, None)
    compiler.pool.shutdown()
    assert entry["compiled"] is True and entry["headline_us"] > case.roofline_s(generation) * 1e6
    assert entry["kernels"]["calls"][0]["name"] == vllm_fused.FUSED
    row = {**row_facts(case, generation), "variants": {vllm_fused.FUSED: entry}}
    (line,) = variant_lines([row])
    assert line["block_sizes"]["bt"] == 8 and "multichip study prices them" in line["not_priced"]
    assert line["vllm_block_sizes"]["bf"] == 384 and line["block_sizes_from"] == "searched"
    assert entry["kernels"]["us"] <= line["vllm_standalone_us"]
    assert line["remote_rows"] == entry["remote_rows"] > 0


def test_a_fused_win_says_what_its_figure_leaves_out():
    """Where vLLM's fused kernel is the faster rival, the row's account of its lead names the parts it is not
    priced for."""
    from benchmarks.studies.moe_layer.targets import summarise

    def variant(us, **facts):
        return {"compiled": True, "headline_us": us, "band": {"p90_us": [us * 0.9, us * 1.1]}, "over_roofline": 1.0,
                "xla_ops": {"us": 0.0, "hbm_bytes": 0}, "hbm_bytes": 1, **facts}

    row = {"generation": "v6e", "variants": {
        "ours": variant(500.0, kernels={"us": 480.0, "step_cost_us": 20.0, "hbm_bytes": 1, "mxu_us": 1.0}),
        vllm_fused.FUSED: variant(480.0, kernels={"us": 480.0, "step_cost_us": 5.0, "hbm_bytes": 1, "mxu_us": 1.0},
                                  not_priced=vllm_fused.NOT_PRICED["ep"], remote_rows=3, dma_descriptors=7)}}
    summarise(row, ["megablox", vllm_fused.FUSED])
    assert row["best_rival"] == vllm_fused.FUSED
    assert "leaves out its 3 rows exchanged with other ranks, its 7 copy descriptors" in row["why_rival_wins"]


def test_the_kernels_own_checks_refuse_what_it_refuses():
    """Gemma 4's hidden size 2816 (11 x 256) takes no 1024-wide w1 block nor 1408-wide w2 chunk: vLLM's default
    formula picks both, so its own pick is refused there, and so are odd token blocks and blocks not dividing the
    padded sizes."""
    gemma = next(s for s in shapes.SETTINGS if s.label == "gemma-4-26b-a4b EP8 router-masking")
    case = shapes.make_case(gemma, 256)
    vllms, _ = vllm_fused.block_sizes(case.model, 256, 8)
    assert (vllms["bd1"], vllms["bd2c"]) == (1024, 1408)
    assert "bd1 one dividing 2816" in vllm_fused.refusal(case, vllms)
    assert "bd2c must be a multiple of 256" in vllm_fused.refusal(case, {**vllms, "bd1": 256, "bd1c": 256})
    assert vllm_fused.replay(case) is None
    good = {"bt": 32, "bf": 768, "bd1": 2816, "bd2": 2816, "btc": 16, "bfc": 768, "bd1c": 2816, "bd2c": 2816}
    assert vllm_fused.refusal(case, good) is None
    assert "bt=6 must be even and divide" in vllm_fused.refusal(case, {**good, "bt": 6, "btc": 6})
    assert "bf one dividing 768" in vllm_fused.refusal(case, {**good, "bf": 512, "bfc": 512})


@pytest.mark.parametrize("label, tokens", [("qwen3-30b-a3b EP8 dispatch", 64), ("gpt-oss-20b EP8 dispatch", 64),
                                           ("gemma-4-26b-a4b EP8 router-masking", 64)])
def test_the_search_takes_only_what_the_kernel_accepts_and_fits_and_finds_the_fastest(label, tokens):
    """Every candidate passes the kernel's checks; on each generation the kept ones fit its VMEM budget; the pick
    is the fastest of every fitting candidate (the bound that cuts the search short cuts no faster one), and no
    slower than vLLM's own pick where that is accepted."""
    from benchmarks.studies.moe_layer import fused_search
    from benchmarks.studies.moe_layer.modelling import standalone

    case = shapes.make_case(next(s for s in shapes.SETTINGS if s.label == label), tokens)
    found = fused_search.candidates(case)
    assert found and all(vllm_fused.refusal(case, sizes) is None for sizes in found)
    for generation in ("v5e", "tpu7x"):
        result = fused_search.search(case, generation)
        fitting = [sizes for sizes in found if fused_search.fits(case, sizes, generation)]
        assert result["fitting"] == len(fitting) and result["priced"] <= len(fitting)
        every = min(standalone(vllm_fused.replay(case, sizes)[0], generation).pipelined_time_s for sizes in fitting)
        best_s, best = result["ranked"][0]
        assert best_s == pytest.approx(every) and best in fitting
        if result["vllm_standalone_us"] is not None:
            assert best_s * 1e6 <= result["vllm_standalone_us"] + 1e-6


def test_the_token_block_stops_at_the_largest_in_vllms_table():
    """Qwen3 on one chip at 2048 tokens: every even divisor of the tokens up to vLLM's largest tuned block (256),
    none beyond it (the kernel's traced program grows with the block)."""
    from benchmarks.studies.moe_layer import fused_search

    assert fused_search.max_token_block() == 256
    case = shapes.make_case(shapes.SETTINGS[0], 2048)
    assert sorted({sizes["bt"] for sizes in fused_search.candidates(case)}) == [2, 4, 8, 16, 32, 64, 128, 256]
