"""One rank of a multi-chip run: load under a transformers parallel plan, kernelize, record what came out.

Launched by tests/test_multichip.py as

    python -m torch.distributed.run --standalone --nproc-per-node N tests/multichip_ranks.py SPEC.json

SPEC (JSON): `repos` (kernel builds for kernelize), `models` (name -> checkpoint folder),
`prompt`, `out` (a folder) and `runs`, each a mode ("tp", "ep_dispatch" or "ep_router"), a model,
optional `tp_plan` overrides and what to do:

- "generate": kernelize, then the prompt's logits and greedy tokens, with what each call of the
  experts and attention functions received;
- "refuse": kernelize with and without fallback, keeping the report and the error (no forward);
- "train": kernelize in TRAINING mode and record which norms kept their parallel-plan wrapper.

Each rank writes `<out>/<run>.rank<r>.pt`. Any error ends the rank with a non-zero exit code, so
torchrun fails the whole launch.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from kernels import Mode
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from tpu_kernels import kernelize


def distributed_config(mode: str, world_size: int, tp_plan: dict | None) -> DistributedConfig:
    """transformers 5.25's three MoE layouts over `world_size` ranks; attention is tensor-parallel in all three.

    Both EP layouts use the model's own `ep_dispatch_experts` plan; `ep_implementation` says how tokens reach the
    experts: exchanged by all-to-all ("ep_dispatch"), or every rank's experts on the shared batch with the other
    ranks' picks masked, summed by an all-reduce ("ep_router", what the router-masking plan did before 5.25).
    """
    if mode == "tp":
        return DistributedConfig(tp_size=world_size, tp_plan=tp_plan)
    if mode == "ep_dispatch":
        return DistributedConfig(tp_size=world_size, tp_plan=tp_plan, ep_size=world_size, ep_implementation="all_to_all")
    if mode == "ep_router":
        return DistributedConfig(tp_size=world_size, tp_plan=tp_plan, ep_size=world_size, ep_implementation="all_reduce")
    raise ValueError(f"unknown mode {mode!r}")


def record_experts_calls(model, calls: list[dict]) -> None:
    """Wrap the selected experts function to note what it receives, then call it."""
    name = model.config._experts_implementation
    experts_forward = ALL_EXPERTS_FUNCTIONS[name]

    def recording_experts_forward(module, hidden_states, top_k_index, top_k_weights):
        down_proj = module.down_proj  # [E, H, I], or [E, I, H] when transposed
        calls.append({
            "rows": hidden_states.shape[0],
            # EP dispatch hands a rank that received no rows one all-zero row (to keep backward connected).
            "zero_dummy": hidden_states.shape[0] == 1 and not hidden_states.any(),
            "top_k": top_k_index.shape[1],
            "local_experts": module.gate_up_proj.shape[0],
            "intermediate": down_proj.shape[1] if module.is_transposed else down_proj.shape[2],
            "sentinel_picks": int((top_k_index == module.num_experts).sum()),
            "max_id": int(top_k_index.max()) if top_k_index.numel() else -1,
            "unit_weights": bool((top_k_weights == 1).all()),
            "plain_weights": all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in module.parameters()),
        })
        return experts_forward(module, hidden_states, top_k_index, top_k_weights)

    ALL_EXPERTS_FUNCTIONS.register(name, recording_experts_forward)


def record_attention_calls(model, calls: list[dict]) -> None:
    name = model.config._attn_implementation
    attention_forward = ALL_ATTENTION_FUNCTIONS[name]

    def recording_attention_forward(module, query, key, value, *args, **kwargs):
        calls.append({"query_heads": query.shape[1], "kv_heads": key.shape[1], "query_len": query.shape[2]})
        return attention_forward(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, recording_attention_forward)


def report_rows(model) -> list[tuple]:
    return [(e.kind, e.replaced, list(e.modules), e.reason) for e in model.tpu_kernels_report.entries]


def generate(model, run: dict, spec: dict) -> dict:
    start = time.perf_counter()
    kernelize(model, repos=spec["repos"])
    experts_calls, attention_calls = [], []
    record_experts_calls(model, experts_calls)
    if model.tpu_kernels_report.replaced("attention"):
        record_attention_calls(model, attention_calls)
    prompt = torch.tensor(spec["prompt"])
    with torch.no_grad():
        logits = model(prompt).logits
        prefill_calls = (len(experts_calls), len(attention_calls))
        tokens = model.generate(prompt, max_new_tokens=run["new_tokens"], do_sample=False) if run["new_tokens"] else None
    return {
        "logits": logits,
        "tokens": tokens,
        "report": report_rows(model),
        "experts_calls": experts_calls[: prefill_calls[0]],
        "attention_calls": attention_calls[: prefill_calls[1]],
        "decode_calls": (len(experts_calls) - prefill_calls[0], len(attention_calls) - prefill_calls[1]),
        "distinct_experts_rows": sorted({call["rows"] for call in experts_calls}),
        "seconds": time.perf_counter() - start,
    }


def refuse(model, run: dict, spec: dict) -> dict:
    kernelize(model, repos=spec["repos"])
    try:
        kernelize(model, repos=spec["repos"], use_fallback=False)
        error = None
    except RuntimeError as raised:
        error = str(raised)
    return {"report": report_rows(model), "error": error}


def train(model, run: dict, spec: dict) -> dict:
    modules = dict(model.named_modules())
    before = {name: m.__dict__.get("forward") for name, m in modules.items() if name.endswith("norm")}
    kernelize(model, mode=Mode.TRAINING, repos={**spec["repos"], "experts": None, "attention": None})
    return {
        "report": report_rows(model),
        "kept_wrapper": sorted(n for n, f in before.items() if f is not None and modules[n].__dict__.get("forward") is f),
        "had_wrapper": sorted(n for n, f in before.items() if f is not None),
    }


ACTIONS = {"generate": generate, "refuse": refuse, "train": train}


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for run in spec["runs"]:
        model_spec = spec["models"][run["model"]]
        config = distributed_config(run["mode"], world_size, run.get("tp_plan"))
        model = AutoModelForCausalLM.from_pretrained(model_spec["path"], distributed_config=config, dtype=torch.float32)
        result = ACTIONS[run["action"]](model.eval(), run, spec)
        torch.save(result, os.path.join(spec["out"], f"{run['name']}.rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
