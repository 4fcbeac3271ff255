"""tpu_kernels/runtime/hardware.py: the TPU facts every kernel (as `_hardware.py`) and the performance model share."""

from __future__ import annotations

import functools
import types
from pathlib import Path

import jax
import jax.numpy as jnp
from tpu_kernels.distribution.loader import get_local_kernel
import pytest
from jax.experimental.pallas import tpu as pltpu

from tpu_kernels.runtime import hardware
from tpu_kernels.distribution.builder import build_kernel_repo

ROOT = Path(__file__).resolve().parents[1]
KERNEL_REPOS = sorted(p.parent for p in (ROOT / "kernel_repos").glob("*/build.toml"))
MIB = 1 << 20


def test_facts_come_from_jax_tpu_table():
    v5e, v6e = hardware.tpu_generation("v5e"), hardware.tpu_generation("v6e")
    assert (v5e.hbm_bytes_per_s, v5e.bf16_flops_per_s, v5e.mxu_size) == (8.2e11, 1.97e14, 128)
    assert (v6e.hbm_bytes_per_s, v6e.bf16_flops_per_s, v6e.mxu_size) == (1.64e12, 9.2e14, 256)
    assert v5e.vmem_capacity_bytes == v6e.vmem_capacity_bytes == 128 * MIB
    assert (v5e.default_scoped_vmem_bytes, v6e.default_scoped_vmem_bytes) == (16 * MIB, 32 * MIB)
    assert (hardware.LANES, hardware.SUBLANES) == (128, 8)
    v5p, tpu7x = hardware.tpu_generation("v5p"), hardware.tpu_generation("tpu7x")
    assert v5p.vmem_capacity_bytes == tpu7x.vmem_capacity_bytes == 64 * MIB
    assert (v5p.default_scoped_vmem_bytes, tpu7x.default_scoped_vmem_bytes) == (16 * MIB, None)
    # A v5p device is two TensorCores (megacore): its roofline takes both; a TPU7x device is one core.
    assert (v5p.cores_per_device, tpu7x.cores_per_device, v5e.cores_per_device) == (2, 1, 1)
    assert (v5p.device_hbm_bytes_per_s, v5p.device_bf16_flops_per_s) == (2 * 1.23e12, 2 * 2.295e14)
    assert (tpu7x.device_hbm_bytes_per_s, tpu7x.device_bf16_flops_per_s) == (3.7e12, 1.155e15)
    with pytest.raises(ValueError, match="unknown TPU generation 'v99'; jax knows v2, v3"):
        hardware.tpu_generation("v99")


def test_tiling_helpers():
    assert [hardware.round_up(x, 128) for x in (0, 1, 128, 129)] == [0, 128, 128, 256]
    assert [hardware.sublane_multiple(d) for d in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.float64)] == [8, 16, 32, 8]
    assert hardware.padded_vmem_bytes((20, 200), jnp.bfloat16) == 32 * 256 * 2
    assert hardware.padded_vmem_bytes((3, 7, 130), jnp.float32) == 3 * 8 * 256 * 4
    assert hardware.padded_vmem_bytes((5,), jnp.int32) == 128 * 4
    assert hardware.padded_vmem_bytes((), jnp.float32) == 4
    assert hardware.vmem_limit_bytes(1 * MIB, "v6e") == 16 * MIB
    assert hardware.vmem_limit_bytes(40 * MIB, "v5e") == 44 * MIB
    assert hardware.vmem_limit_bytes(200 * MIB, "v6e") == 100 * MIB
    # 64 MiB of VMEM per core on v5p and TPU7x: at most 56 MiB asked for; TPU7x leaves Mosaic 8 MiB, not 4.
    assert hardware.vmem_limit_bytes(40 * MIB, "tpu7x") == 48 * MIB
    assert hardware.vmem_limit_bytes(40 * MIB, "v5p") == 44 * MIB
    assert hardware.vmem_limit_bytes(60 * MIB, "v5p") == 56 * MIB
    assert [hardware.vmem_budget_bytes(g) >> 20 for g in ("v5e", "v5p", "v6e", "tpu7x")] == [96, 52, 96, 48]


@pytest.mark.parametrize("margin", [1.0, 1.25, 1.5])
@pytest.mark.parametrize("generation", hardware.SUPPORTED_GENERATIONS)
def test_the_vmem_policy_asks_for_a_working_set_within_its_budget_what_it_needs(generation, margin):
    """The budget is the most whose limit, with the same margin and Mosaic's scratch, a kernel may ask for."""
    budget = hardware.vmem_budget_bytes(generation, margin=margin)
    needed = int(budget * margin) + hardware.mosaic_scratch_bytes(generation)
    assert hardware.vmem_limit_bytes(budget, generation, margin=margin) == needed
    assert hardware.max_vmem_limit_bytes(generation) - margin < needed <= hardware.max_vmem_limit_bytes(generation)
    # A kernel's own bound only lowers it.
    assert hardware.vmem_budget_bytes(generation, margin=margin, bound_bytes=8 * MIB) == 8 * MIB
    assert hardware.vmem_budget_bytes(generation, margin=margin, bound_bytes=budget + 1) == budget


def test_check_and_resolve_generation(monkeypatch):
    assert [hardware.check_generation(g) for g in ("v5e", "v5p", "v6e", "tpu7x")] == ["v5e", "v5p", "v6e", "tpu7x"]
    with pytest.raises(ValueError, match=r"generation must be one of \('v5e', 'v5p', 'v6e', 'tpu7x'\), got 'v4'"):
        hardware.check_generation("v4")
    monkeypatch.delenv(hardware.GENERATION_ENV, raising=False)
    assert hardware.resolve_generation(None) == "v6e"  # off TPU
    assert hardware.resolve_generation("v5e") == "v5e"


def test_resolve_target_gives_the_facts_of_a_supported_generation_once(monkeypatch):
    """A name, the facts themselves (of this file or a build's copy: only their name is read) or None (this
    device's) give the one cached value of that generation's facts; an unsupported name is refused."""
    monkeypatch.delenv(hardware.GENERATION_ENV, raising=False)
    v5e = hardware.resolve_target("v5e")
    assert v5e is hardware.tpu_generation("v5e") and v5e.name == "v5e" and v5e.mxu_size == 128
    assert hardware.resolve_target(v5e) is v5e
    assert hardware.resolve_target(types.SimpleNamespace(name="v5e")) is v5e
    assert hardware.resolve_target(None) is hardware.resolve_target("v6e")  # off TPU
    monkeypatch.setenv(hardware.GENERATION_ENV, "tpu7x")
    assert hardware.resolve_target() is hardware.tpu_generation("tpu7x")
    for unsupported in ("v4", hardware.tpu_generation("v4")):
        with pytest.raises(ValueError, match=r"generation must be one of \('v5e', 'v5p', 'v6e', 'tpu7x'\), got 'v4'"):
            hardware.resolve_target(unsupported)


def _on_a_tpu(monkeypatch, device_kind: str, chip: str | None):
    """Makes this process look like it runs on a TPU of `device_kind` that jax's table maps to `chip`."""
    device = types.SimpleNamespace(platform="tpu", device_kind=device_kind)
    monkeypatch.setattr(jax, "devices", lambda *args: [device])

    def get_tpu_info():
        if chip is None:
            raise ValueError(f"Unsupported TPU device kind: {device_kind}")
        return pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(chip), 1)

    monkeypatch.setattr(pltpu, "get_tpu_info", get_tpu_info)


def test_current_generation_on_supported_and_unsupported_tpus(monkeypatch):
    monkeypatch.delenv(hardware.GENERATION_ENV, raising=False)
    _on_a_tpu(monkeypatch, "TPU v5 lite", "v5e")
    assert hardware.current_generation() == "v5e"
    _on_a_tpu(monkeypatch, "TPU v6 lite", "v6e")
    assert hardware.current_generation() == "v6e"
    for kind in ("TPU v5", "TPU v5p"):
        _on_a_tpu(monkeypatch, kind, "v5p")
        assert hardware.current_generation() == "v5p"
    _on_a_tpu(monkeypatch, "TPU7x", "7x")
    assert hardware.current_generation() == "tpu7x"
    for kind, chip in (("TPU v4", "v4"), ("TPU v9 something", None)):
        _on_a_tpu(monkeypatch, kind, chip)
        with pytest.raises(hardware.UnsupportedTpuError,
                           match=rf"this TPU \('{kind}'\).*\('v5e', 'v5p', 'v6e', 'tpu7x'\)"):
            hardware.current_generation()
    monkeypatch.setenv(hardware.GENERATION_ENV, "v5e")
    assert hardware.current_generation() == "v5e"


def test_generation_override_must_name_a_supported_generation(monkeypatch):
    monkeypatch.setenv(hardware.GENERATION_ENV, "v5e")
    assert hardware.current_generation() == "v5e"
    monkeypatch.setenv(hardware.GENERATION_ENV, "v4")
    with pytest.raises(ValueError, match="TPU_KERNELS_GENERATION: generation must be one of"):
        hardware.current_generation()


@pytest.fixture(scope="module")
def built_kernels(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    return {repo.name: build_kernel_repo(repo, out) for repo in KERNEL_REPOS}


def test_every_build_carries_the_same_facts(built_kernels):
    source = Path(hardware.__file__).read_bytes()
    assert set(built_kernels) == {"attention-tpu", "ragged-dot-tpu", "rmsnorm-tpu"}
    for built in built_kernels.values():
        for variant in (built / "build").iterdir():
            assert (variant / "_hardware.py").read_bytes() == source


def test_kernel_repos_derive_no_hardware_facts_of_their_own():
    """Generation detection and device facts live in hardware.py only."""
    for repo in KERNEL_REPOS:
        for path in (repo / "torch-ext").rglob("*.py"):
            text = path.read_text()
            for marker in ("device_kind", "get_tpu_info", "def _round_up", "def current_generation", "8.2e11"):
                assert marker not in text, f"{path.relative_to(ROOT)} has {marker!r}"


def test_an_unsupported_tpu_gets_the_same_error_from_every_kernel(built_kernels, monkeypatch):
    monkeypatch.delenv(hardware.GENERATION_ENV, raising=False)
    loaded = {name: get_local_kernel(built, backend="cpu") for name, built in built_kernels.items()}
    q, kv = jax.ShapeDtypeStruct((1, 8, 1, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 1, 128, 128), jnp.bfloat16)
    rows, weight = jax.ShapeDtypeStruct((64, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16)

    def traced(function, *arrays):
        """The program of a kernel's JAX function, which resolves its generation when it is traced: traced anew
        (jax's caches cleared), so that no earlier trace answers."""
        jax.clear_caches()
        return str(jax.make_jaxpr(function)(*arrays))

    experts = jax.ShapeDtypeStruct((1, 2048, 1536), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32)
    selects = {
        # Each kernel resolves the generation where a call enters it, its JAX functions.
        "ragged-dot-tpu": lambda k: traced(k.gmm.kernel.grouped_matmul, rows, *experts),
        "rmsnorm-tpu": lambda k: traced(functools.partial(k.norm.kernel.rms_norm_forward, eps=1e-6), rows, weight),
        "attention-tpu": lambda k: traced(k.flash.kernel.flash_attention_forward, q, kv, kv),
    }
    off_tpu = {name: select(loaded[name]) for name, select in selects.items()}
    _on_a_tpu(monkeypatch, "TPU v6 lite", "v6e")
    assert {name: select(loaded[name]) for name, select in selects.items()} == off_tpu
    _on_a_tpu(monkeypatch, "TPU v4", "v4")
    for name, select in selects.items():
        with pytest.raises(RuntimeError, match=r"this TPU \('TPU v4'\) is not one the kernels are tuned"):
            select(loaded[name])


# Weights-like shapes on both sides of each condition of the rule: lanes (a, b vs 128), the 8-row
# multiple (b), dtypes of 1, 2 and 4 bytes (their sublane packing differs; the rule does not).
_LAYOUT_SHAPES = [
    (128, 2816, 704), (16, 2816, 704), (2, 2816, 704),  # Gemma 4 down_proj (full, EP8 rank, tiny)
    (128, 2048, 768), (32, 2880, 5760), (32, 2880, 2880),  # Qwen3, GPT-OSS: nothing to swap
    (8, 256, 72), (8, 256, 200), (8, 256, 36), (8, 256, 129), (8, 200, 256), (8, 100, 72), (256, 72), (3, 4, 256, 40),
]


@pytest.mark.aot
@pytest.mark.slow
@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "tpu7x"])
def test_default_layout_rule_matches_the_compiler(generation):
    from tpu_kernels.aot import topology_device

    sharding = jax.sharding.SingleDeviceSharding(topology_device(generation))
    for dtype in (jnp.bfloat16, jnp.float32, jnp.int8):
        # One program takes every shape: XLA picks each parameter's layout on its own.
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape in _LAYOUT_SHAPES]
        compiled = jax.jit(lambda *weights: [w + 1 for w in weights]).lower(*args).compile()
        for shape, arg_format in zip(_LAYOUT_SHAPES, compiled.input_formats[0]):
            major_to_minor = arg_format.layout.major_to_minor
            swapped = major_to_minor[-2:] == (len(shape) - 1, len(shape) - 2)
            predicted = hardware.default_layout_swaps_minor_dims(shape)
            if shape[-2] % hardware.LANES == 0 or shape[-1] % hardware.LANES == 0:
                assert swapped == predicted, (shape, jnp.dtype(dtype).name)
            else:  # both unaligned: XLA weighs the padding; the rule claims nothing (its docstring)
                assert not predicted
    assert hardware.default_layout_swaps_minor_dims((128, 2816, 704))
    assert not hardware.default_layout_swaps_minor_dims((128, 2048, 768))


def test_kernels_tile_by_the_calibrated_step_cost_where_one_was_fitted():
    from benchmarks import perf

    assert hardware.grid_step_overhead_s("tpu7x") == perf.grid_step_s("tpu7x") == 0.72e-6
    # v5e's fit (0.34 us) is within the rule of thumb's rounding; v5p's and v6e's timings fit no step of their own.
    assert [hardware.grid_step_overhead_s(g) for g in ("v5e", "v5p", "v6e")] == [0.35e-6] * 3
