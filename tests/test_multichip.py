"""kernelize under transformers' tensor- and expert-parallel plans, on 2 and 4 CPU processes.

Each world size is one `torchrun` launch (gloo) of tests/multichip_ranks.py running every mode on
tiny Qwen3-MoE, Mixtral and GPT-OSS checkpoints (at 4 ranks each mode on one of them: FOUR_RANK_RUNS)
with experts, RMSNorm and attention kernelized; the ranks' logits and greedy tokens are compared here
with the single-process eager model. One launch per world size rather than per mode: the kernels
compile once per shape and process, and the modes share most shapes.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from kernels import Mode
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen3MoeConfig

from tpu_kernels.distribution.builder import build_kernel_repo
from tpu_kernels.integration.parallel import applied_plan, replacement_conflict, uneven_attention_heads

from .conftest import REPO_ROOT

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MODES = ("tp", "ep_dispatch", "ep_router")
TOKENS, TOP_K, EXPERTS, INTERMEDIATE = 10, 2, 8, 64  # prompt: 2 rows x 5 tokens
# Two greedy tokens: the prefill's and one decode step's. Each step's attention has a new key length, compiled anew
# in every rank's interpret mode; a second decode step would add those compiles and no case the first lacks.
NEW_TOKENS = 2
LAUNCH_TIMEOUT_SECONDS = 1200

# 8 query and 4 key/value heads: whole heads and the GQA ratio on every rank at tp_size 2 and 4.
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
              head_dim=64, max_position_embeddings=256)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                                        num_experts_per_tok=TOP_K, intermediate_size=96),
    "mixtral": lambda: MixtralConfig(**COMMON, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                                     num_experts_per_tok=TOP_K),
    "gpt_oss": lambda: GptOssConfig(**COMMON, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                                    num_experts_per_tok=TOP_K, layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=4),  # the 5-token prompt and every step slide
    # 6 query / 2 key/value heads: a 3:1 GQA ratio per rank at tp_size 2, heads cut apart at tp_size 4.
    "qwen3_moe_gqa3": lambda: Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 1, "num_attention_heads": 6,
                                                "num_key_value_heads": 2},
                                             moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                                             num_experts_per_tok=TOP_K, intermediate_size=96),
}
# transformers 5.22 gives GPT-OSS no tensor-parallel plan: under "tp" it runs replicated.
HAS_TP_PLAN = {"qwen3_moe": True, "mixtral": True, "gpt_oss": False}
# Per model, what each rank's kernelize report must say: experts, these norms and attention replaced.
NORMS = {"qwen3_moe": 9, "mixtral": 5, "gpt_oss": 5}  # 2 layers x (input, post-attention[, q, k]) + final
REPLICATED_ATTENTION = {f"model.layers.*.self_attn.{p}_proj": "replicate" for p in "qkvo"}


# At 4 ranks each mode once, on a model whose layers it splits in a way 2 ranks do not show: Qwen3-MoE's
# intermediate dim and heads in quarters, GPT-OSS's 2 local experts behind the all-to-all, Mixtral's router
# masking of 3 ranks' picks in 4. Every mode-model pair runs at 2 ranks.
FOUR_RANK_RUNS = (("tp", "qwen3_moe"), ("ep_dispatch", "gpt_oss"), ("ep_router", "mixtral"))


def _runs(world_size: int) -> list[dict]:
    pairs = [(mode, model) for mode in MODES for model in NORMS] if world_size == 2 else FOUR_RANK_RUNS
    runs = [dict(name=f"{mode}.{model}", mode=mode, model=model, action="generate", new_tokens=NEW_TOKENS)
            for mode, model in pairs]
    if world_size == 2:
        runs.append(dict(name="tp.qwen3_moe_gqa3", mode="tp", model="qwen3_moe_gqa3", action="generate", new_tokens=0))
        runs.append(dict(name="train.qwen3_moe", mode="tp", model="qwen3_moe", action="train"))
    else:
        runs.append(dict(name="tp.qwen3_moe_gqa3", mode="tp", model="qwen3_moe_gqa3", action="refuse"))
        runs.append(dict(name="tp_replicated_attention.qwen3_moe_gqa3", mode="tp", model="qwen3_moe_gqa3",
                         action="generate", new_tokens=0, tp_plan=REPLICATED_ATTENTION))
    return runs


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Kernel builds, checkpoints, and the single-process eager logits and tokens of each."""
    root = tmp_path_factory.mktemp("multichip")
    repos = {kind: str(build_kernel_repo(REPO_ROOT / "kernel_repos" / name, root / "build"))
             for kind, name in (("experts", "ragged-dot-tpu"), ("rmsnorm", "rmsnorm-tpu"), ("attention", "attention-tpu"))}
    prompt = torch.randint(0, 128, (2, TOKENS // 2), generator=torch.Generator().manual_seed(7))
    models, references = {}, {}
    for name, make_config in CONFIGS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 3:  # expert weights start empty in some models: random, never zero
                    parameter.normal_(std=0.1)
            references[name] = (model(prompt).logits, model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False))
        model.save_pretrained(root / name)
        models[name] = {"path": str(root / name)}
    return {"root": root, "repos": repos, "models": models, "prompt": prompt.tolist(), "references": references}


def _launch(checkpoints, world_size: int) -> dict[str, list[dict]]:
    """One torchrun launch; each run's per-rank results. Fails if any rank fails or the launch hangs."""
    out = checkpoints["root"] / f"world{world_size}"
    out.mkdir()
    runs = _runs(world_size)
    spec = {key: checkpoints[key] for key in ("repos", "models", "prompt")} | {"out": str(out), "runs": runs}
    (out / "spec.json").write_text(json.dumps(spec))
    log = out / "torchrun.log"
    # No torch_tpu autoload: the ranks run the kernels' CPU variants with or without it, and without it each of
    # the launcher and the ranks starts with about 2 s less CPU.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               str(REPO_ROOT / "tests" / "multichip_ranks.py"), str(out / "spec.json")]
    with open(log, "w") as log_file:
        launch = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = launch.wait(timeout=LAUNCH_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)  # torchrun and the ranks it started
            launch.wait()
            returncode = "timeout"
    if returncode != 0:
        lines = [line for line in log.read_text().splitlines() if not line.startswith(("I0", "W0"))]
        pytest.fail(f"torchrun with {world_size} ranks ended with {returncode}:\n" + "\n".join(lines[-60:]))
    results = {}
    for run in runs:
        results[run["name"]] = [torch.load(out / f"{run['name']}.rank{rank}.pt", weights_only=False)
                                for rank in range(world_size)]
    return results


def _run(world_size: int, name: str) -> dict:
    (run,) = [run for run in _runs(world_size) if run["name"] == name]
    return run


def _entry(report, kind):
    (entry,) = [e for e in report if e[0] == kind]
    return entry


def _check_report(name: str, report) -> None:
    kind, replaced, modules, _ = _entry(report, "experts")
    assert replaced and len(modules) == 2, report
    kind, replaced, modules, _ = _entry(report, "rmsnorm")
    assert replaced and len(modules) == NORMS[name], report
    kind, replaced, modules, _ = _entry(report, "attention")
    assert replaced and len(modules) == 2, report


def _check_experts_calls(mode: str, name: str, ranks: list[dict], world_size: int) -> None:
    """What transformers hands the experts function in each mode (prefill, one call per layer)."""
    per_rank = [r["experts_calls"] for r in ranks]
    assert all(len(calls) == 2 for calls in per_rank), per_rank
    assert all(call["plain_weights"] for calls in per_rank for call in calls), per_rank
    local_experts = EXPERTS if mode == "tp" else EXPERTS // world_size
    for layer in range(2):
        calls = [calls[layer] for calls in per_rank]
        # transformers 5.25's tensor-parallel plans leave the experts whole (its ep_plan shards them by expert).
        assert all(c["local_experts"] == local_experts and c["intermediate"] == INTERMEDIATE
                   for c in calls), (mode, name, [(c["local_experts"], c["intermediate"]) for c in calls])
        if mode == "tp":  # all tokens, top-k, every expert, the whole intermediate dim
            assert all(c["rows"] == TOKENS and c["top_k"] == TOP_K and c["sentinel_picks"] == 0 for c in calls), calls
        elif mode == "ep_dispatch":  # the rows sent to this rank, k=1, weight 1, local ids; each pick once
            assert all(c["top_k"] == 1 and c["unit_weights"] and c["max_id"] < local_experts for c in calls), calls
            assert sum(c["rows"] for c in calls if not c["zero_dummy"]) == TOKENS * TOP_K, calls
        else:  # all tokens, top-k, other ranks' picks as sentinel id = local expert count; each pick once
            assert all(c["rows"] == TOKENS and c["top_k"] == TOP_K and c["max_id"] <= local_experts for c in calls)
            assert sum(TOKENS * TOP_K - c["sentinel_picks"] for c in calls) == TOKENS * TOP_K, calls


def _check_generated(checkpoints, run: dict, ranks: list[dict], heads: tuple[int, int]) -> None:
    logits, tokens = checkpoints["references"][run["model"]]
    for rank, result in enumerate(ranks):
        where = f"{run['name']} rank {rank}"
        assert (result["logits"] - logits).abs().max().item() <= 1e-4, where
        assert torch.equal(result["logits"], ranks[0]["logits"]), f"{where} disagrees with rank 0"
        if run["new_tokens"]:
            assert torch.equal(result["tokens"], tokens), where
            experts_decode_calls, attention_decode_calls = result["decode_calls"]
            assert experts_decode_calls > 0 and (attention_decode_calls > 0 or not result["attention_calls"]), where
        for call in result["attention_calls"]:  # attention sees this rank's heads only
            assert (call["query_heads"], call["kv_heads"]) == heads, (where, call)


@pytest.mark.parametrize("world_size", [2, 4])
def test_modes_match_single_process_eager(checkpoints, world_size):
    results = _launch(checkpoints, world_size)
    local_heads = (8 // world_size, 4 // world_size)
    for run in _runs(world_size):
        ranks = results[run["name"]]
        if run["action"] == "generate" and run["model"] in NORMS:
            for result in ranks:
                _check_report(run["model"], result["report"])
            # Without a tensor-parallel plan (GPT-OSS) attention is replicated: every rank has all heads.
            heads = local_heads if HAS_TP_PLAN[run["model"]] else (8, 4)
            _check_generated(checkpoints, run, ranks, heads)
            _check_experts_calls(run["mode"], run["model"], ranks, world_size)

    if world_size == 2:
        # A 3:1 GQA ratio on each rank (3 query heads, 1 key/value head) is served.
        ranks = results["tp.qwen3_moe_gqa3"]
        assert all(_entry(r["report"], "attention")[1] for r in ranks)
        _check_generated(checkpoints, _run(2, "tp.qwen3_moe_gqa3"), ranks, (3, 1))
        # In training every norm is replaced: transformers 5.25 all-reduces the gradients of Qwen3's q_norm/k_norm
        # from a forward pre-hook, not a wrapper, and the hook stays with our forward.
        for result in results["train.qwen3_moe"]:
            assert result["had_wrapper"] == [] and result["kept_wrapper"] == [], result
            _, replaced, modules, _ = _entry(result["report"], "rmsnorm")
            assert replaced and len(modules) == 9, result
    else:
        # 6 query / 2 key/value heads over 4 ranks would cut heads apart: refused, clearly.
        for result in results["tp.qwen3_moe_gqa3"]:
            _, replaced, _, reason = _entry(result["report"], "attention")
            assert not replaced and "6 query and 2 key/value heads do not divide by 4" in reason, reason
            assert result["error"] == f"kernelize: attention not replaced: {reason}"
            assert _entry(result["report"], "experts")[1] and _entry(result["report"], "rmsnorm")[1]
        # The remedy the refusal names: attention kept whole, served with all heads on every rank.
        ranks = results["tp_replicated_attention.qwen3_moe_gqa3"]
        assert all(_entry(r["report"], "attention")[1] for r in ranks)
        _check_generated(checkpoints, _run(4, "tp_replicated_attention.qwen3_moe_gqa3"), ranks, (6, 2))


def test_replacement_conflict_by_style_mode_and_wrapper():
    plan = {"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce", "model.norm": "sequence_parallel",
            "model.layers.*.mlp.shared_norm": "replicate"}
    wrapped, hooked = torch.nn.LayerNorm(4), torch.nn.LayerNorm(4)
    wrapped.forward = lambda x: x  # what a plan style that wraps the forward leaves: an instance attribute
    hooked.register_forward_pre_hook(lambda module, args: None)  # what a style that hooks it leaves
    q_norm = "model.layers.3.self_attn.q_norm"
    assert replacement_conflict(plan, q_norm, wrapped, Mode.INFERENCE) is None  # it only all-reduces gradients
    assert "'replicated_with_grad_allreduce'" in replacement_conflict(plan, q_norm, wrapped, Mode.TRAINING)
    assert replacement_conflict(plan, q_norm, hooked, Mode.TRAINING) is None  # the hook stays with our forward
    assert "'sequence_parallel'" in replacement_conflict(plan, "model.norm", wrapped, Mode.INFERENCE)
    for mode in (Mode.INFERENCE, Mode.TRAINING):
        assert replacement_conflict(plan, "model.layers.0.mlp.shared_norm", wrapped, mode) is None
        assert replacement_conflict(plan, "model.layers.0.input_layernorm", wrapped, mode) is None


def test_one_process_models_have_no_plan():
    """The config's plan applies only once transformers sharded the model: not on one process, nor a plain module."""
    model = AutoModelForCausalLM.from_config(CONFIGS["qwen3_moe_gqa3"]())
    assert model.tp_plan and applied_plan(model) == {} and uneven_attention_heads(model) is None
    assert applied_plan(torch.nn.Linear(2, 2)) == {} and uneven_attention_heads(torch.nn.Linear(2, 2)) is None
