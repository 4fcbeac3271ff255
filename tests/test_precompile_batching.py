"""precompile's warm-up for continuous batching: every kernel shape a continuous batch can reach, run before
`generate_batch` meets it."""

import types

import jax
import pytest
import torch
from transformers import ContinuousBatchingConfig

from tpu_kernels import kernelize
from tpu_kernels.integration.precompile import precompile
from tpu_kernels.integration.precompile_batching import batching_steps
from tpu_kernels.runtime.buckets import key_bucket, token_bucket

from .test_continuous_batching import CONFIGS, attention_on_hub, builds, generate_batch, prompts, tiny_model  # noqa: F401


def every_reachable_shape(max_batch_tokens, max_requests, max_keys, max_total_keys) -> set[tuple]:
    """The kernel shapes of every batch within the limits, by looking at each count of sequences, queries, longest
    queries and keys."""
    shapes = set()
    for sequences in range(1, max_requests + 1):
        sequences_bucket = max(16, 1 << (sequences - 1).bit_length())
        for total_q in range(sequences, max_batch_tokens + 1):
            rows = token_bucket(total_q)
            for longest in range(1, min(total_q, max_keys) + 1):
                if sequences - 1 <= total_q - longest <= (sequences - 1) * longest:
                    bound = 1 if longest == 1 else min(token_bucket(longest), rows)
                    for total_k in range(total_q, min(max_total_keys, sequences * max_keys) + 1):
                        shapes.add((rows, key_bucket(total_k), sequences_bucket, bound))
    return shapes


@pytest.mark.parametrize("limits", [(20, 3, 40, 10 ** 9), (40, 5, 150, 400), (33, 20, 20, 300), (16, 1, 300, 300),
                                    (40, 20, 9, 10 ** 9)])
def test_batching_steps_reach_every_shape_a_batch_can_and_no_other(limits):
    max_batch_tokens, max_requests, max_keys, max_total_keys = limits
    steps = batching_steps(*limits)
    assert {step.kernel_shape() for step in steps} == every_reachable_shape(*limits)
    assert len({step.kernel_shape() for step in steps}) == len(steps)
    for step in steps:
        assert sum(step.queries) <= max_batch_tokens and len(step.queries) <= max_requests
        assert sum(step.keys) <= max_total_keys and max(step.keys) <= max_keys
        assert all(1 <= q <= k for q, k in zip(step.queries, step.keys))


def test_precompile_refuses_a_batch_whose_bounds_transformers_infers_at_run_time():
    model = types.SimpleNamespace(config=CONFIGS["qwen3_moe"]())  # refused before anything runs: no model needed
    model.config._attn_implementation = "org/attention-tpu:flash_attn_varlen_func"
    with pytest.raises(ValueError, match="max_batch_tokens and max_requests_per_batch"):
        precompile(model, max_tokens=8, max_keys=16, progress=False, continuous_batching=ContinuousBatchingConfig())
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="only on a flash implementation"):
        precompile(model, max_tokens=8, max_keys=16, progress=False, continuous_batching=ContinuousBatchingConfig(
            max_batch_tokens=32, max_requests_per_batch=3))


@pytest.mark.slow
def test_after_precompile_continuous_batching_compiles_no_kernel(attention_on_hub, builds):
    """A kernelized tiny Qwen3-MoE on our flash path, precompiled for continuous batching of at most 32 tokens and 3
    requests a step, requests of up to 48 keys: a generate_batch of mixed prompts (chunked prefills, prefills beside decodes,
    decodes) then compiles no jax program."""
    model = tiny_model("qwen3_moe")
    kernelize(model, repos={"experts": str(builds["ragged-dot-tpu"]), "rmsnorm": str(builds["rmsnorm-tpu"]),
                            "attention": f"{attention_on_hub}@1"})
    options = dict(max_batch_tokens=32, max_requests_per_batch=3, page_size=16, num_blocks=32)
    compiles = []

    def record(event, _seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        # Its batch-1 generates at their fewest (max_tokens 1): continuous batching's steps are warmed apart.
        precompile(model, max_tokens=1, max_keys=48, progress=False,
                   continuous_batching=ContinuousBatchingConfig(**options))
        assert compiles  # the warm-up compiled what the steps below need
        compiles.clear()
        generate_batch(model, prompts([1, 5, 44, 17, 2, 30]), 4, **options)
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert compiles == []
