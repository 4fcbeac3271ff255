"""benchmarks.studies.moe_layer's on-disk cache: an analysis cached before the model changed is not reused."""

from pathlib import Path

from benchmarks.studies import moe_layer
from benchmarks.studies.moe_layer.cache import CLOCK

ROOT = Path(__file__).resolve().parents[1]


def test_compile_keys_ignore_the_model_and_replay_keys_follow_perf(monkeypatch):
    """A compile is keyed by what the compiler sees (module text, library versions): a model change never
    recompiles. A replay is the replay modules' work: its key changes with their source."""
    compile_key = moe_layer.Cache(None).key("compile", "v6e", "the same module")
    replay_key = moe_layer.Cache(None).key("replay", "the same jaxpr")
    assert moe_layer.Cache(None).key("replay", "the same jaxpr") == replay_key
    monkeypatch.setattr(moe_layer.cache, "source_fingerprint", lambda *modules: "the replay after a change")
    assert moe_layer.Cache(None).key("compile", "v6e", "the same module") == compile_key
    assert moe_layer.Cache(None).key("replay", "the same jaxpr") != replay_key
    assert moe_layer.Cache(None).key("compile", "v6e", "another module") != compile_key


def test_a_cached_compile_is_reanalysed_not_recompiled(tmp_path):
    """The cache holds what the compile left (HLO text, cost, memory); a second run reads it back and analyses
    it under the current model, without compiling."""
    import jax
    import jax.numpy as jnp

    avals = [jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)]

    def fn(x):
        return (x * 2).sum(axis=0)

    first = moe_layer.Cache(tmp_path)
    compiler = moe_layer.Compiler(first, 1)
    program = compiler.submit(fn, avals, "v5e", kind="test layers").result()
    compiler.pool.shutdown()
    assert first.misses == 1 and first.hits == 0
    # The run's facts say what the compile was of.
    assert CLOCK.seconds["compile test layers with kernel bodies (summed over threads)"] > 0
    again = moe_layer.Cache(tmp_path)
    cached = moe_layer.Compiler(again, 1).submit(fn, avals, "v5e", kind="test layers").result()
    assert again.hits == 1 and again.misses == 0
    assert type(cached) is type(program) and cached.ops == program.ops and cached.hbm_bytes == program.hbm_bytes


def test_tracked_json_is_one_object_per_line_with_sorted_keys():
    import json

    report = {"shapes": [{"b": 1, "a": [1, 2]}, {"a": 3}], "targets": {"z": {"rows": [{"y": 1, "x": 2}]}, "a": 1.5}}
    text = moe_layer.dump_compact(report)
    assert json.loads(text) == report
    lines = [line.strip().rstrip(",") for line in text.splitlines()]
    assert '{"a": [1, 2], "b": 1}' in lines and '{"a": 3}' in lines and '{"x": 2, "y": 1}' in lines
    assert text.index('"a": 1.5') < text.index('"z"')


def test_rival_layer_computes_the_experts_layer(tmp_path):
    """The layer the benchmark builds around a rival's grouped matmul is the experts layer: with XLA's
    ragged_dot (which runs on the CPU) it matches the kernel repo's float64 reference, with weights read
    in their stored order (a swapped down_proj, as Gemma 4's) or taken as [E, K, N] (as the XLA and vLLM
    rivals take them), and other ranks' sentinel picks."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    import torch
    from tpu_kernels.distribution.builder import build_kernel_repo
    from tpu_kernels.distribution.loader import get_local_kernel

    reference = get_local_kernel(build_kernel_repo(ROOT / "kernel_repos" / "ragged-dot-tpu", tmp_path),
                                 backend="cpu").reference
    tokens, hidden, intermediate, experts, top_k = 11, 256, 72, 6, 3
    for model in (moe_layer.MODELS["gemma-4-26b-a4b"], moe_layer.MODELS["gpt-oss-20b"]):
        model = dataclasses.replace(model, hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k)
        assert moe_layer.stored_order(model, "down")[0] == (model.name.startswith("gemma")), model.name
        rng = np.random.default_rng(0)
        gate_up_shape = (experts, hidden, 2 * intermediate) if model.weights_transposed else (
            experts, 2 * intermediate, hidden)
        down_shape = (experts, intermediate, hidden) if model.weights_transposed else (experts, hidden, intermediate)
        index = np.stack([rng.permutation(experts + 2)[:top_k] for _ in range(tokens)])
        index = np.where(index < experts, index, experts).astype(np.int32)  # ids past the rank: sentinels
        weights = np.where(index < experts, rng.random((tokens, top_k)), 0.0).astype(np.float32)
        arrays = [rng.standard_normal((tokens, hidden)).astype(np.float32), index, weights,
                  (0.2 * rng.standard_normal(gate_up_shape)).astype(np.float32),
                  (0.2 * rng.standard_normal(down_shape)).astype(np.float32)]
        if model.bias:
            arrays += [(0.5 * rng.standard_normal((experts, 2 * intermediate))).astype(np.float32),
                       (0.5 * rng.standard_normal((experts, hidden))).astype(np.float32)]
        expected = reference.gated_experts_reference(
            *map(torch.from_numpy, arrays), activation=model.activation, weights_transposed=model.weights_transposed,
            interleaved=model.interleaved, alpha=model.alpha, limit=model.limit).numpy()
        for weights_k_n in (False, True):
            rival = dataclasses.replace(moe_layer.RIVALS["xla_ragged_dot"], weights_k_n=weights_k_n)
            given = list(arrays)
            if weights_k_n and not model.weights_transposed:
                given[3:5] = [np.swapaxes(w, 1, 2) for w in given[3:5]]
            out = np.asarray(moe_layer.rival_layer(rival, model, [None, None])(*map(jnp.asarray, given)),
                             dtype=np.float64)
            assert np.abs(out - expected).max() <= 1e-4 * np.abs(expected).max(), (model.name, weights_k_n)


def test_quantized_variants_take_the_kernels_arguments_and_minimum(tmp_path):
    """The one-byte variants: their arguments are what the kernel repo's common/quant.py expects, and their
    minimum bytes count each active expert's one-byte weights and f32 scales once (the anchor, by hand)."""
    from tpu_kernels.distribution.builder import build_kernel_repo
    from tpu_kernels.distribution.loader import get_local_kernel

    built = get_local_kernel(build_kernel_repo(ROOT / "kernel_repos" / "ragged-dot-tpu", tmp_path), backend="cpu")
    setting = next(s for s in moe_layer.SETTINGS if s.label == moe_layer.ANCHOR[0])
    case = moe_layer.make_case(setting, moe_layer.ANCHOR[1])
    h, i, rows, picks = 2048, 768, 256, 256 * 8
    activations = 2 * rows * h * 2 + picks * (4 + 2)
    assert moe_layer.quantized_min_bytes(built, case, "int8") == (
        activations + case.active_experts * (3 * h * i + (2 * i + h) * 4))
    assert moe_layer.quantized_min_bytes(built, case, "fp8") == (
        activations + case.active_experts * (3 * h * i + (16 * 12 + 6 * 16) * 4))
    for scheme, dtype in moe_layer.QUANTIZED.items():
        args = moe_layer.quantized_avals(built, case, scheme, concrete_index=False)
        assert [a.dtype for a in args[3:5]] == [dtype, dtype]
        assert [a.shape for a in args[5:]] == [
            built.expected_scales_shape(scheme, shape, 1) for shape in case.weight_shapes()]


def test_the_kernel_is_built_at_the_same_path_on_every_cached_run(tmp_path):
    """A Mosaic kernel's lowered text embeds its source paths: a build in a fresh temporary folder per run
    would miss every cached compile of ours."""
    with moe_layer.build_folder(tmp_path) as first:
        pass
    with moe_layer.build_folder(tmp_path) as second:
        assert second == first == tmp_path / "build"
    with moe_layer.build_folder(None) as temporary:
        assert temporary.is_dir() and tmp_path not in temporary.parents


def test_rivals_are_searched_under_each_generations_scoped_vmem():
    """Each generation's search holds the blocks under its default scoped limit; TPU7x, which has no fixed one,
    under v6e's 32 MiB (rivals.TPU7X_SCOPED_VMEM_BYTES)."""
    from benchmarks.studies.moe_layer.rivals import RIVALS, block_vmem_bytes, candidate_tilings

    megablox = RIVALS["megablox"]
    shape = (2048, 2048, 1536)  # Qwen3-30B-A3B's gate_up at 256 tokens x top-8
    v5e, tpu7x = (candidate_tilings(megablox, *shape, (g,)) for g in ("v5e", "tpu7x"))
    assert candidate_tilings(megablox, *shape, ("v5p",)) == v5e
    assert candidate_tilings(megablox, *shape, ("tpu7x",)) == candidate_tilings(megablox, *shape, ("v6e",))
    assert max(map(block_vmem_bytes, v5e)) <= 16 << 20 < max(map(block_vmem_bytes, tpu7x)) <= 32 << 20
    assert set(candidate_tilings(megablox, *shape, ("v5e", "tpu7x"))) == set(v5e) | set(tpu7x)


def test_v5p_search_splits_megablox_over_both_cores():
    """megablox's gmm (as vLLM's) declares its grid's N axis "parallel": on v5p's two TensorCores the search holds
    N blocks that split it, and at a weight-streaming shape v5p's best splits N and beats the whole-N block (the
    largest block, which the earlier search alone kept)."""
    import numpy as np

    from benchmarks.studies.moe_layer.modelling import standalone
    from benchmarks.studies.moe_layer.rivals import RIVALS
    from benchmarks.studies.moe_layer.shapes import Case, Model, Setting
    from benchmarks.studies.moe_layer.tuning import tune_rival

    model = Model("two-core", hidden=256, intermediate=256, experts=4, top_k=2, activation="silu")
    picks = np.random.default_rng(0).integers(0, model.experts, (48, model.top_k), dtype=np.int32)
    case = Case(Setting(model, 1, "local"), 48, picks)
    tuning = tune_rival(moe_layer.Cache(None), RIVALS["megablox"], case, ("v5p",))
    (best, best_replay), _ = tuning["per_generation"]["v5p"]
    whole_n = [entry["standalone_us"]["v5p"] for entry in tuning["searched"]
               if entry["projection"] == "gate_up" and entry["tiling"][2] == 2 * model.intermediate]
    assert best[2] < 2 * model.intermediate, best
    assert whole_n and standalone(best_replay, "v5p").pipelined_time_s * 1e6 < min(whole_n)


def test_a_run_without_v6e_has_no_entry_for_hfs_v6e_timing():
    """Hugging Face measured its 257 us layer on v6e: a run of other generations (v5p, TPU7x) writes no
    hf_257us entry rather than one with no shapes."""
    from benchmarks.studies.moe_layer.hf import hf_case

    rows = [{"generation": generation, "setting": "qwen3-30b-a3b EP8 dispatch", "tokens": 256, "variants": {}}
            for generation in ("v5p", "tpu7x")]
    assert hf_case(rows, moe_layer.Cache(None)) is None


def test_the_search_holds_the_blocks_the_earlier_one_won_with():
    """The broader search keeps the earlier one's winners: tokamax's GPT-OSS blocks from the fourth-largest values
    of its space, vLLM's DeepSeek-V3 K blocks of an eighth of K."""
    from benchmarks.studies.moe_layer.rivals import RIVALS, candidate_tilings

    assert (128, 2944, 1024) in candidate_tilings(RIVALS["tokamax"], 8, 2880, 5760, ("v5e",))
    assert (128, 1024, 2944) in candidate_tilings(RIVALS["tokamax"], 8, 2880, 2880, ("v5e",))
    assert (128, 896, 2048) in candidate_tilings(RIVALS["vllm_gmm"], 8, 7168, 4096, ("v5e",))
    assert (128, 256, 7168) in candidate_tilings(RIVALS["vllm_gmm"], 8, 2048, 7168, ("v5e",))
