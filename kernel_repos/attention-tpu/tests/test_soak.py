"""A soak of the flash-attn API: hundreds of distinct shapes and options in one process, forward and backward.

Long CPU processes that had compiled a few hundred interpret-mode programs died in native code (issue 75), while
each case passed in a fresh process: the programs they kept held more memory mappings than Linux allows a process
(the binding's CPU_PROGRAMS_KEPT, docs/binding.md). This walks cases like theirs through `flash_attn_func` and
`flash_attn_varlen_func` (forward only, which takes the ragged paged kernel, and forward and backward, which take
the flash kernels), with and without sinks, and checks every output and gradient against flash-attn's semantics
(conftest's `flash_reference`). Nearly every case is a program of its own: its lengths' buckets, head counts and
head dim, dtype and static options differ from the cases before it.

In the suite the walk is short (`SUITE_CASES`). At full size (marker `soak`, run only when `-m` names it: the root
conftest) it walks `FULL_CASES` cases `FULL_PASSES` times in one process, counting the programs jax compiles.
"""

import random
import sys
import time
from contextlib import contextmanager
from typing import NamedTuple

import jax
import pytest
import torch
from tpu_kernels.testing import assert_matches

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
SUITE_CASES = 3
FULL_CASES = 400
FULL_PASSES = 3
# A full pass must compile at least this many programs, or it soaks too little to find what issue 75 saw.
FULL_PROGRAMS_AT_LEAST = 300

# (query length, key length): decode, chunks against a longer cache, more queries than keys, lengths on and off
# the bucket edges (the kernels are handed 16..256 query rows, 128..512 key rows).
LENGTHS = [(239, 1), (1, 1), (1, 37), (1, 239), (5, 37), (7, 7), (19, 19), (37, 5), (64, 64), (100, 130),
           (128, 128), (17, 129), (239, 239), (200, 300), (3, 500), (33, 260)]
HEADS = [(4, 2), (4, 4), (4, 1), (8, 2), (2, 1)]  # (query heads, key/value heads): GQA, MHA, MQA
WINDOW_LEFTS = [3, 16, 100]
SOFTCAPS = [0.0, 4.0, 30.0]
SCALES = [None, 0.09]


class Case(NamedTuple):
    varlen: bool
    q_lengths: tuple[int, ...]  # one per sequence (flash_attn_func: all equal)
    kv_lengths: tuple[int, ...]
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    softmax_scale: float | None
    sinks: bool


# The case that crashed the second run of issue 75 (with sinks, forward and backward: 239 queries over 1 key, head
# dim 64, causal, no window, no softcap, GQA) comes first, so the suite's short walk has it too.
ISSUE_CASE = Case(False, (239,), (1,), 4, 2, 64, torch.float32, True, (-1, -1), 0.0, None, True)


def make_case(index: int) -> Case:
    """The walk's case `index` (0 is ISSUE_CASE), drawn from the options above by a generator seeded with it."""
    if index == 0:
        return ISSUE_CASE
    draw = random.Random(index)
    q_len, kv_len = draw.choice(LENGTHS)
    causal = draw.random() < 0.6
    left = draw.choice([-1, -1, *WINDOW_LEFTS])
    window_size = (left, draw.choice([0, left]) if left >= 0 else -1) if causal else (left, -1)
    varlen = draw.random() < 0.4
    sequences = draw.randint(1, 3)
    if varlen:
        q_lengths = (q_len, *(draw.randint(0, q_len) for _ in range(sequences - 1)))
        kv_lengths = (kv_len, *(draw.randint(1, kv_len) for _ in range(sequences - 1)))
    else:
        q_lengths, kv_lengths = (q_len,) * sequences, (kv_len,) * sequences
    q_heads, kv_heads = draw.choice(HEADS)
    return Case(varlen, q_lengths, kv_lengths, q_heads, kv_heads, draw.choice([64, 128]),
                draw.choice([torch.float32, torch.float32, torch.bfloat16]), causal, window_size,
                draw.choice(SOFTCAPS), draw.choice(SCALES), draw.random() < 0.4)


def _inputs(case: Case, seed: int) -> dict[str, torch.Tensor]:
    """Random q, k, v (packed for varlen, batched otherwise), output cotangent and sinks, in the case's dtype."""
    generator = torch.Generator().manual_seed(seed)
    total_q, total_kv = sum(case.q_lengths), sum(case.kv_lengths)
    if case.varlen:
        q_shape, kv_shape = (total_q, case.q_heads, case.head_dim), (total_kv, case.kv_heads, case.head_dim)
    else:
        batch = len(case.q_lengths)
        q_shape = (batch, case.q_lengths[0], case.q_heads, case.head_dim)
        kv_shape = (batch, case.kv_lengths[0], case.kv_heads, case.head_dim)
    shapes = dict(q=q_shape, k=kv_shape, v=kv_shape, d_out=q_shape, sinks=(case.q_heads,) if case.sinks else None)
    return {name: torch.randn(*shape, generator=generator).to(case.dtype)
            for name, shape in shapes.items() if shape is not None}


def _options(case: Case) -> dict:
    return dict(causal=case.causal, window_size=case.window_size, softcap=case.softcap,
                softmax_scale=case.softmax_scale)


def _cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _attend(kernel, case: Case, tensors: dict) -> torch.Tensor:
    """The case's call of the flash-attn API on `tensors` (q, k, v, maybe sinks)."""
    sinks = tensors.get("sinks")
    if not case.varlen:
        return kernel.flash_attn_func(tensors["q"], tensors["k"], tensors["v"], s_aux=sinks, **_options(case))
    return kernel.flash_attn_varlen_func(tensors["q"], tensors["k"], tensors["v"], _cumulative(case.q_lengths),
                                         _cumulative(case.kv_lengths), max(case.q_lengths), max(case.kv_lengths),
                                         s_aux=sinks, **_options(case))


def _expected(flash_reference, case: Case, tensors: dict) -> torch.Tensor:
    """flash-attn's output of the case, float64, sequence by sequence."""
    options, sinks = _options(case), tensors.get("sinks")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if not case.varlen:
        return torch.stack([flash_reference(q[b], k[b], v[b], sinks=sinks, **options) for b in range(q.shape[0])])
    q_starts, kv_starts = _cumulative(case.q_lengths).tolist(), _cumulative(case.kv_lengths).tolist()
    return torch.cat([flash_reference(q[q_starts[b]:q_starts[b + 1]], k[kv_starts[b]:kv_starts[b + 1]],
                                      v[kv_starts[b]:kv_starts[b + 1]], sinks=sinks, **options)
                      for b in range(len(case.q_lengths))])


def check_case(kernel, flash_reference, case: Case, seed: int) -> None:
    """The case's output (forward only, and with gradients) and gradients against flash-attn's, on fresh inputs."""
    tensors = _inputs(case, seed)
    names = [name for name in ("q", "k", "v", "sinks") if name in tensors]
    d_out = tensors.pop("d_out")
    references = {name: tensors[name].double().requires_grad_() for name in names}
    expected = _expected(flash_reference, case, references)
    expected_grads = torch.autograd.grad(expected, list(references.values()), d_out.double())
    tolerance = TOLERANCE[case.dtype]
    if case.varlen:  # without a gradient to compute, the varlen form takes the ragged paged kernel
        with torch.no_grad():
            assert_matches(_attend(kernel, case, tensors), expected.detach(), tolerance, f"{case} forward only")
    leaves = {name: tensor.clone().requires_grad_() for name, tensor in tensors.items()}
    out = _attend(kernel, case, leaves)
    assert out.dtype == case.dtype
    assert_matches(out.detach(), expected.detach(), tolerance, f"{case} output")
    # A gradient sums up to max(lengths) terms of the inputs' scale (1): rounding grows as its square root, and is
    # all there is where the gradient is zero in exact arithmetic (one key: dq, dk).
    floor = max(*case.q_lengths, *case.kv_lengths) ** 0.5
    for name, grad, expected_grad in zip(names, torch.autograd.grad(out, list(leaves.values()), d_out),
                                         expected_grads):
        assert_matches(grad, expected_grad, tolerance, f"{case} d{name}", floor=floor)


@contextmanager
def counting_compiles():
    """A list that gains one entry per program jax compiles (its backend compile event) inside the block."""
    compiles = []

    def record(event, _seconds, **_):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(record)


@pytest.mark.slow
def test_a_short_walk_of_the_soak_passes(kernel, flash_reference):
    for index in range(SUITE_CASES):
        check_case(kernel, flash_reference, make_case(index), seed=index)


def test_the_walk_is_of_distinct_cases_and_includes_both_forms():
    cases = [make_case(index) for index in range(FULL_CASES)]
    assert len(set(cases)) == FULL_CASES
    assert {case.varlen for case in cases} == {False, True} and {case.sinks for case in cases} == {False, True}
    assert {case.head_dim for case in cases} == {64, 128} and {case.causal for case in cases} == {False, True}


@pytest.mark.soak
def test_full_soak_in_one_process(kernel, flash_reference):
    """FULL_PASSES passes over FULL_CASES cases, fresh inputs each pass; prints the programs compiled per pass."""
    with counting_compiles() as compiles:
        for walk in range(FULL_PASSES):
            start, compiled_before = time.monotonic(), len(compiles)
            for index in range(FULL_CASES):
                check_case(kernel, flash_reference, make_case(index), seed=walk * FULL_CASES + index)
                print(f"soak pass {walk + 1} case {index + 1}/{FULL_CASES}: {len(compiles)} programs compiled",
                      file=sys.stderr, flush=True)
            print(f"soak pass {walk + 1} done in {time.monotonic() - start:.0f} s: {len(compiles) - compiled_before} "
                  f"programs compiled in it, {len(compiles)} in all", file=sys.stderr, flush=True)
            if walk == 0:
                assert len(compiles) >= FULL_PROGRAMS_AT_LEAST
