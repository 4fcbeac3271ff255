"""The compile benchmark: the shapes a workload compiles, without and with buckets, and their priced seconds."""

import jax
import pytest

from benchmarks.studies import compiles
from benchmarks.studies.tables.compiles import render_markdown
from tpu_kernels.distribution.loader import get_local_kernel
from tpu_kernels.runtime.buckets import key_bucket

QWEN3 = compiles.MODELS["Qwen3-30B-A3B"]


@pytest.fixture(scope="module")
def built(kernel_builds):
    """The three kernels' torch-cpu variants, by the kinds the benchmark names them."""
    return {kind: get_local_kernel(kernel_builds[repo], backend="cpu")
            for kind, repo in (("rmsnorm", "rmsnorm-tpu"), ("experts", "ragged-dot-tpu"),
                               ("attention", "attention-tpu"))}


def test_a_generate_without_buckets_compiles_attention_at_every_key_length():
    (before,) = compiles.shapes_of(QWEN3, [compiles.calls_of_request(100, new_tokens=20)], bucketed=False)
    (after,) = compiles.shapes_of(QWEN3, [compiles.calls_of_request(100, new_tokens=20)], bucketed=True)
    decode_keys = {shape[3] for shape in before if shape[0] == "attention" and shape[2] == 1}
    assert decode_keys == set(range(101, 120))
    assert {shape[3] for shape in after if shape[0] == "attention"} == {key_bucket(100), key_bucket(119)} == {128}
    # Rows: the prompt and one token, each for the layer norm, the 32 q heads and the 4 k heads; a per-head
    # norm's bucket is its tokens' bucket times its heads (the 4 k heads of the prompt and the 32 q heads of
    # the decode step share 512 rows).
    assert sorted(shape[1:] for shape in before if shape[0] == "rms_norm") == [
        (1, 2048), (4, 128), (32, 128), (100, 2048), (400, 128), (3200, 128)]
    assert sorted(shape[1:] for shape in after if shape[0] == "rms_norm") == [
        (16, 2048), (64, 128), (128, 2048), (512, 128), (4096, 128)]
    assert {shape[1] for shape in after if shape[0] == "experts"} == {16, 128}


def test_per_head_norms_of_prompts_in_one_token_bucket_share_their_shapes():
    prefills = [compiles.op_shapes(QWEN3, prompt, prompt, bucketed=True) for prompt in (1000, 1020)]
    assert prefills[0] == prefills[1]
    assert {shape[1] for shape in prefills[0] if shape[0] == "rms_norm" and shape[2] == 128} == {1024 * 32, 1024 * 4}


def test_the_trace_is_seeded_and_spans_the_prompt_range():
    first, second = compiles.workloads()["serving trace"], compiles.workloads()["serving trace"]
    assert first == second and len(first) == compiles.TRACE_REQUESTS
    prompts = [calls[0][0] for calls in first]
    assert 1 <= min(prompts) < 200 and 3900 < max(prompts) <= compiles.TRACE_MAX_PROMPT


def test_sample_positions_keep_both_ends_and_all_of_a_small_group():
    assert compiles.sample_positions(3, 4) == [0, 1, 2]
    assert compiles.sample_positions(10, 4) == [0, 3, 6, 9]
    assert compiles.sample_positions(2, 2) == [0, 1]


@pytest.mark.aot
def test_sampled_shapes_are_compiled_and_the_rest_interpolated(built):
    shapes = {("rms_norm", rows, 256) for rows in (16, 24, 40)}
    priced = compiles.measure(compiles.Kernels(built), QWEN3, shapes, "v6e", sample=2, log=lambda line: None)
    low, middle, high = (priced[("rms_norm", rows, 256)] for rows in (16, 24, 40))
    assert low[1] and high[1] and not middle[1] and low[0] > 0 and high[0] > 0
    assert middle[0] == pytest.approx((low[0] + high[0]) / 2)
    summary = compiles.summary([{("rms_norm", 16, 256), ("rms_norm", 24, 256)}, shapes], priced)
    assert (summary["distinct_shapes"], summary["measured_shapes"]) == (3, 2)
    assert summary["extrapolated_s"] == pytest.approx(middle[0])
    assert summary["first_call_s"] == pytest.approx(low[0] + middle[0])
    table = render_markdown({"cpu_count": 2, "load_average_at_start": [3.2, 2.0, 1.0], "models": {"Qwen3-30B-A3B": {"v6e": {"generate": {"before": summary,
                                                                                "after": summary}}}}})
    assert "| Qwen3-30B-A3B | generate | v6e | 3 | 3 |" in table["first-call"]
    assert "wall seconds on 2 cores at load average 3" in table["first-call"]


def test_attention_targets_carry_sinks_and_windows(built):
    gpt_oss = compiles.MODELS["GPT-OSS-20B"]
    sliding = gpt_oss.attention[0]
    fn, avals = compiles.Kernels(built).target(gpt_oss, ("attention", sliding, 1, 256), "v6e")
    assert [a.shape for a in avals] == [(1, 64, 1, 64), (1, 8, 256, 64), (1, 8, 256, 64), (1,), (64,)]
    assert jax.eval_shape(fn, *avals).shape == (1, 64, 1, 64)
