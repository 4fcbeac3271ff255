"""benchmarks/moe_layer.py's on-disk cache: an analysis cached before the model changed is not reused."""

import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_moe_layer():
    spec = importlib.util.spec_from_file_location("moe_layer", ROOT / "benchmarks" / "moe_layer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("moe_layer", module)
    spec.loader.exec_module(module)
    return module


def test_cache_keys_change_when_the_model_code_changes(tmp_path, monkeypatch):
    moe_layer = load_moe_layer()
    for source in moe_layer.MODEL_SOURCES:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / source, tmp_path / source)
    monkeypatch.setattr(moe_layer, "ROOT", tmp_path)
    before = moe_layer.Cache(None).key("replay", "the same jaxpr")
    assert moe_layer.Cache(None).key("replay", "the same jaxpr") == before
    with open(tmp_path / "tpu_kernels" / "perf.py", "a") as perf:
        perf.write("\n# a changed model\n")
    assert moe_layer.Cache(None).key("replay", "the same jaxpr") != before


def test_rival_layer_computes_the_experts_layer(tmp_path):
    """The layer the benchmark builds around a rival's grouped matmul is the experts layer: with XLA's
    ragged_dot (which runs on the CPU) it matches the kernel repo's float64 reference, with weights read
    in their stored order (a swapped down_proj, as Gemma 4's) and other ranks' sentinel picks."""
    import dataclasses

    import jax.numpy as jnp
    import numpy as np
    import torch
    from tpu_kernels.loader import get_local_kernel

    from tpu_kernels.builder import build_kernel_repo

    moe_layer = load_moe_layer()
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
        layer = moe_layer.rival_layer(moe_layer.RIVALS["xla_ragged_dot"], model, [None, None])
        out = np.asarray(layer(*map(jnp.asarray, arrays)), dtype=np.float64)
        expected = reference.gated_experts_reference(
            *map(torch.from_numpy, arrays), activation=model.activation, weights_transposed=model.weights_transposed,
            interleaved=model.interleaved, alpha=model.alpha, limit=model.limit).numpy()
        assert np.abs(out - expected).max() <= 1e-4 * np.abs(expected).max(), model.name


def test_quantized_variants_take_the_kernels_arguments_and_minimum(tmp_path):
    """The one-byte variants: their arguments are what the kernel repo's quant.py expects, and their minimum
    bytes count each active expert's one-byte weights and f32 scales once (the anchor, by hand)."""
    from tpu_kernels.loader import get_local_kernel

    from tpu_kernels.builder import build_kernel_repo

    moe_layer = load_moe_layer()
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
            built.quant.expected_scales_shape(scheme, shape, 1) for shape in case.weight_shapes()]
