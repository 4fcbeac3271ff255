"""The compile benchmark: the shapes a workload compiles, without and with buckets, and their priced seconds."""

import importlib

import jax
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.studies import bucketing_programs, compiles
from benchmarks.studies.tables.compiles import render_markdown
from tpu_kernels.distribution.loader import get_local_kernel
from tpu_kernels.runtime.buckets import key_bucket

from .conftest import REPO_ROOT

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
    after = {**summary, "bucketing_programs": summary}
    table = render_markdown({"cpu_count": 2, "load_average_at_start": [3.2, 2.0, 1.0],
                             "models": {"Qwen3-30B-A3B": {"v6e": {"generate": {"before": summary, "after": after}}}}})
    assert "| Qwen3-30B-A3B | generate | v6e | 3 | 3 |" in table["first-call"]
    assert "wall seconds on 2 cores at load average 3" in table["first-call"]


def test_attention_targets_carry_sinks_and_windows(built):
    gpt_oss = compiles.MODELS["GPT-OSS-20B"]
    sliding = gpt_oss.attention[0]
    fn, avals = compiles.Kernels(built).target(gpt_oss, ("attention", sliding, 1, 256), "v6e")
    assert [a.shape for a in avals] == [(1, 64, 1, 64), (1, 8, 256, 64), (1, 8, 256, 64), (1,), (64,)]
    assert jax.eval_shape(fn, *avals).shape == (1, 64, 1, 64)


# A model small enough to run the entry points at once: two attention kinds (one windowed), per-head norms, float32
# routing weights (as Gemma 4's router hands them over).
TINY = compiles.Model(hidden=64, q_heads=4, attention=(compiles.Attention(2, 32), compiles.Attention(1, 16, window=8)),
                      qk_norms=True, experts=8, intermediate=32, top_k=2, gate={}, router_weights="float32")
VIEWS = {"view", "_unsafe_view", "transpose", "permute", "expand", "unsqueeze", "squeeze", "t", "alias", "detach"}
# The real key lengths and offsets, made from host data (attention's padding.lengths_tensor): a [batch] tensor whatever
# the lengths, no scalar argument.
FIXED_SHAPE = {"lift_fresh"}


class BucketingLog(TorchDispatchMode):
    """The pads, slices and any other non-view ops the entry points run, as the study writes its programs; the
    shapes the (fake) kernels are handed."""

    def __init__(self):
        super().__init__()
        self.programs, self.kernel_inputs, self.paused = set(), [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name, source = func.overloadpacket.__name__, args[0]
        if self.paused or name in VIEWS | FIXED_SHAPE:
            return out
        dtype = str(source.dtype).removeprefix("torch.")
        if name == "constant_pad_nd":
            self.programs.add(("pad", dtype, int(args[2]) if len(args) > 2 else 0, tuple(source.shape),
                               tuple(out.shape)))
        elif name == "slice":
            self.programs.add(("slice", dtype, tuple(source.shape), tuple(out.shape)))
        else:
            self.programs.add(("other op", name, tuple(getattr(source, "shape", ()))))
        return out

    def kernel(self, *inputs: torch.Tensor) -> torch.Tensor:
        """A kernel's fake: its inputs' shapes noted, a random result of the first's shape."""
        self.paused = True
        self.kernel_inputs.append(tuple(tuple(t.shape) for t in inputs))
        result = torch.randn(inputs[0].shape).to(inputs[0].dtype)
        self.paused = False
        return result


def _forward(built: dict, experts_module, log: BucketingLog, tokens: int, keys: int) -> None:
    """The entry points one forward of TINY runs, as the study models it: layer norm, q and k norms, attention per
    kind through flash_attn_func (with the keys the cache hands that kind), the experts layer; random bf16
    activations, made before the log starts."""
    bf16, model = torch.bfloat16, TINY
    norm, flash = built["rmsnorm"].rms_norm, built["attention"].flash_attn_func
    norms = [(torch.randn(1, tokens, model.hidden, dtype=bf16), torch.rand(model.hidden, dtype=bf16) + 0.5)]
    attentions = []
    for kind in model.attention:
        norms += [(torch.randn(1, tokens, heads, kind.head_dim, dtype=bf16), torch.rand(kind.head_dim, dtype=bf16) + 0.5)
                  for heads in (model.q_heads, kind.kv_heads)]
        attentions.append((torch.randn(1, tokens, model.q_heads, kind.head_dim, dtype=bf16),
                           *(torch.randn(1, kind.keys_seen(tokens, keys), kind.kv_heads, kind.head_dim, dtype=bf16)
                             for _ in range(2)),
                           (kind.window - 1 if kind.window else -1, 0)))
    routed = (torch.randn(tokens, model.hidden, dtype=bf16), torch.randint(0, model.experts, (tokens, model.top_k)),
              torch.rand(tokens, model.top_k, dtype=getattr(torch, model.router_weights)) + 0.1)
    with log:
        for x, weight in norms:
            norm(x, weight, 1e-6)
        for q, k, v, window in attentions:
            flash(q, k, v, causal=True, window_size=window)
        built["experts"].experts_forward(experts_module, *routed)


@pytest.fixture
def kernels_faked(built, monkeypatch):
    """The entry points with their kernels replaced by a fake that logs what it is handed."""
    log = BucketingLog()
    norm_ops = importlib.import_module(f"{built['rmsnorm'].__name__}.ops")
    monkeypatch.setattr(norm_ops, "_rms_norm_op", lambda rows, weight, eps, offset: log.kernel(rows))
    experts_ops = importlib.import_module(f"{built['experts'].__name__}.ops")
    monkeypatch.setattr(experts_ops, "gated_experts", lambda hidden, *args, **options: log.kernel(hidden, *args[:2]))
    flash_api = importlib.import_module(f"{built['attention'].__name__}.flash_api")
    monkeypatch.setattr(flash_api, "flash_attention", lambda q, k, v, **options: log.kernel(q, k, v))
    return log


@pytest.mark.parametrize("calls, one_bucket", [([(20, 20), (27, 27)], True), ([(1, 130), (1, 131)], True),
                                               ([(16, 16), (1, 128)], False)],
                         ids=["prefills in one bucket", "decode steps in one key bucket", "sizes on bucket edges"])
def test_the_studys_bucketing_programs_are_the_ops_the_entry_points_run(built, kernels_faked, calls, one_bucket):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    experts_module = Qwen3MoeExperts(Qwen3MoeConfig(
        hidden_size=TINY.hidden, moe_intermediate_size=TINY.intermediate, num_experts=TINY.experts,
        num_experts_per_tok=TINY.top_k)).to(torch.bfloat16)
    handed = []
    for tokens, keys in calls:
        kernels_faked.programs, kernels_faked.kernel_inputs = set(), []
        _forward(built, experts_module, kernels_faked, tokens, keys)
        assert kernels_faked.programs == bucketing_programs.programs(TINY, tokens, keys), (tokens, keys)
        handed.append(kernels_faked.kernel_inputs)
    if one_bucket:  # the kernels see one shape; only the programs around them differ
        assert handed[0] == handed[1]


def test_a_sliding_layer_sees_the_key_lengths_transformers_default_cache_hands_it():
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    torch.manual_seed(0)
    window, prompt = 8, 13
    kinds = (compiles.Attention(1, 16), compiles.Attention(1, 16, window=window))
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=window)]
    calls = compiles.calls_of_request(prompt, new_tokens=12)
    assert calls[0] == (prompt, prompt) and calls[1][0] == 1
    for tokens, keys in calls:
        for index, kind in enumerate(kinds):
            new_keys = torch.randn(1, 1, tokens, 16)
            handed, _ = cache.update(new_keys, torch.randn_like(new_keys), index)
            assert handed.shape[2] == kind.keys_seen(tokens, keys), (index, tokens, keys)
    assert kinds[1].keys_seen(1, prompt + 11) == window


def test_a_decode_step_pads_its_keys_at_a_new_shape_each_step():
    steps = [bucketing_programs.programs(QWEN3, 1, keys) for keys in (130, 131, 256)]
    key_pads = [{p for p in step if p[0] == "pad" and p[-1][1] == key_bucket(130)} for step in steps]
    assert key_pads[0] == {("pad", "bfloat16", 0, (1, 130, 4, 128), (1, 256, 4, 128))}
    assert key_pads[1] == {("pad", "bfloat16", 0, (1, 131, 4, 128), (1, 256, 4, 128))}
    assert key_pads[2] == set()  # keys that fill their bucket are handed over as they are
    assert steps[0] - key_pads[0] == steps[1] - key_pads[1]  # the rest is one decode step's, whatever its keys


@pytest.mark.aot
def test_bucketing_programs_are_compiled_for_the_chip_int64_ids_included(built):
    programs = {("pad", "int64", 128, (rows, 8), (16, 8)) for rows in (3, 5, 9)}
    priced = compiles.measure(compiles.Kernels(built), QWEN3, programs, "v6e", sample=2, log=lambda line: None)
    assert [priced[("pad", "int64", 128, (rows, 8), (16, 8))][1] for rows in (3, 5, 9)] == [True, False, True]
    fn, avals = bucketing_programs.target(("pad", "int64", 128, (3, 8), (16, 8)))
    with jax.enable_x64(True):
        assert str(jax.jit(fn).lower(*avals).out_info.dtype) == "int64"


def _summary(shapes: int, total: float, first: float, **extra) -> dict:
    return {"distinct_shapes": shapes, "measured_shapes": shapes, "total_s": total, "extrapolated_s": 0.0,
            "first_call_s": first, "per_op": {}, **extra}


def test_the_table_gives_the_bucketing_programs_beside_the_kernels():
    after = _summary(31, 158.0, 9.0, bucketing_programs=_summary(659, 33.0, 7.0))
    data = {"cpu_count": 2, "load_average_at_start": [3.2, 2.0, 1.0],
            "models": {"Qwen3-30B-A3B": {"v6e": {"generate": {"before": _summary(630, 968.0, 179.0), "after": after}}}}}
    row = "| Qwen3-30B-A3B | generate | v6e | 630 | 31 | 968 | 158 | 659 | 33 | 179 / 9 + 7 |"
    assert row in render_markdown(data)["first-call"]


@pytest.mark.slow
def test_end_to_end_programs_of_a_generate_by_cache_and_origin(kernel_builds):
    """Every program of a whole generate, kernels faked: with the recipe's static cache a decode step adds none in the
    forward; with transformers' dynamic cache its cache and mask ops and our padding of the grown keys add some per
    token; with the recipe's dynamic cache, grown in key buckets, only transformers' 2-D mask ops."""
    from transformers import AutoModelForCausalLM

    from benchmarks.studies import compiles_end_to_end
    from tpu_kernels import kernelize

    repos = {kind: str(kernel_builds[repo]) for kind, repo in (
        ("experts", "ragged-dot-tpu"), ("rmsnorm", "rmsnorm-tpu"), ("attention", "attention-tpu"))}
    counted = {}
    for cache, (recipe, implementation) in compiles_end_to_end.CACHES.items():
        model = AutoModelForCausalLM.from_config(compiles_end_to_end.tiny_models()["Qwen3-30B-A3B"]()).eval()
        model.generation_config.eos_token_id = None
        kernelize(model, repos=repos, fixed_shapes=False)
        counted[cache] = compiles_end_to_end.count(model, recipe, [5, 9], 4, implementation)
    dynamic, bucketed, static = counted.values()
    assert static["forward_per_decode_step_after_the_first"] == dict.fromkeys(compiles_end_to_end.ORIGINS, 0)
    assert dynamic["forward_per_decode_step_after_the_first"]["transformers"] > 0
    assert dynamic["forward_per_decode_step_after_the_first"]["our kernels"] == 0
    assert dynamic["forward_per_decode_step_after_the_first"]["our other ops"] > 0
    # Grown in key buckets, nothing of ours per token; transformers' 2-D mask (cast and padded per length) met these
    # lengths in the first request, whose prompt has the same token bucket.
    assert bucketed["forward_per_decode_step_after_the_first"] == dict.fromkeys(compiles_end_to_end.ORIGINS, 0)
    assert dynamic["later_requests_per_request"]["our other ops"] > bucketed["later_requests_per_request"][
        "our other ops"]
    for measured in counted.values():
        assert measured["first_request"]["our kernels"] > 0 and measured["first_request"]["transformers"] > 0
    # The second prompt (9 tokens) is padded to the first's bucket (16): its prefill and steps are all known.
    assert static["later_requests_per_request"]["our kernels"] == 0
    table = render_markdown({"end_to_end": {"prompts": [5, 9], "new_tokens": 4, "models": {"tiny": counted}},
                             "models": {}, "cpu_count": 2, "load_average_at_start": [1.0]})["end-to-end"]
    assert "| tiny | dynamic | first request |" in table


def test_the_recipe_line_gives_the_first_call_beside_the_steady_state():
    """The README's line (compiles.md, "recipe"), from the committed study: the first request's programs off the
    host, its kernels and their measured seconds, a later request's and a decode step's."""
    import json

    from benchmarks.studies.tables.compiles import recipe_line

    data = json.loads((REPO_ROOT / "benchmarks" / "results" / "compiles.json").read_text())
    counts = data["end_to_end"]["models"]["Qwen3-30B-A3B"]["static at a key bucket (the recipe)"]
    first = counts["first_request"]
    line = recipe_line(data)
    programs = first["our kernels"] + first["our other ops"] + first["transformers"] + first["other"]
    assert f"compiles {programs:,.0f} programs, {first['our kernels']:,.0f} of them kernels" in line
    seconds = data["models"]["Qwen3-30B-A3B"]["v6e"]["generate"]["after"]["first_call_s"]
    assert f"v6e: {seconds:,.0f} s of kernel compiles" in line and line.endswith("a decode step after the first 0.")
    assert "\n" not in line
