"""The binding's CPU path: what comes back from JAX is the caller's alone, and an op keeps a bounded number of
compiled programs (issue 75). Why what it hands JAX lives and stays unchanged for the call: docs/binding.md."""

import sys

import jax
import pytest
import torch

from tpu_kernels.runtime import binding
from tpu_kernels.runtime.binding import jax_torch_op


def echo_and_double(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    doubled = y * 2
    return x, doubled, doubled


def test_outputs_share_memory_with_no_input_and_no_other_output():
    op = jax_torch_op("tk_test_handoff::echo_and_double")(echo_and_double)
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    echoed, doubled, again = op(x, y)
    pointers = {t.untyped_storage().data_ptr() for t in (x, y, echoed, doubled, again)}
    assert len(pointers) == 5
    expected_x = x.clone()
    echoed.add_(1.0)
    assert torch.equal(x, expected_x)
    x.mul_(5.0)
    assert torch.equal(echoed, expected_x + 1.0) and torch.equal(doubled, again)


def scaled(x: jax.Array, scale: float) -> jax.Array:
    return x * scale


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def test_an_op_drops_its_programs_when_it_holds_cpu_programs_kept(monkeypatch):
    monkeypatch.setattr(binding, "CPU_PROGRAMS_KEPT", 4)
    op = jax_torch_op("tk_test_handoff::scaled")(scaled)
    jitted = op.registered.jax_function.jitted
    x = torch.randn(8, 128)
    held = []
    for scale in range(1, 10):  # a program per scale
        torch.testing.assert_close(op(x, float(scale)), x * scale)
        held.append(jitted._cache_size())
    assert held == [1, 2, 3, 0, 1, 2, 3, 0, 1]
    torch.testing.assert_close(op(x, 1.0), x)  # dropped, compiled again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vm.max_map_count and /proc/self/maps are Linux's")
def test_dropped_programs_give_back_their_memory_mappings(monkeypatch):
    """What the bound is for: jax frees a dropped program's mappings (a jax that kept them elsewhere would not)."""
    monkeypatch.setattr(binding, "CPU_PROGRAMS_KEPT", 12)
    op = jax_torch_op("tk_test_handoff::scaled_mappings")(scaled)
    x = torch.randn(8, 128)
    op(x, 0.5)
    before = _mappings()
    for scale in range(1, 11):
        op(x, float(scale))
    held = _mappings()
    op(x, 11.0)  # the 12th program: all are dropped
    assert held - before >= 10 and _mappings() <= before + (held - before) // 4  # each program holds a few
