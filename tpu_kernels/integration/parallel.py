"""What transformers' tensor- and expert-parallel plans mean for kernelize.

`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N, ep_size=M, ep_plan=...))`
shards a model over processes by a plan: a style per module name ("colwise", "rowwise",
"ep_dispatch_experts", ...). Each style shards weights and may wrap the module's forward with transforms
and collectives, or hook it (hooks stay when the forward is replaced). Two things follow for kernelize:

* Attention under tensor parallelism sees this rank's heads only. That serves exactly when the
  query and key/value head counts both divide by tp_size (each rank keeps whole heads and the GQA
  ratio); otherwise the projections cut heads apart and no attention function can serve them.
* Replacing a module's forward drops a wrapper the plan put around it. That is exact only where the
  wrapper does nothing in the pass being run. (transformers 5.25 all-reduces the gradients of Qwen3's
  q_norm/k_norm from a forward pre-hook, which a replaced forward keeps.)

Experts need nothing here: the plans hand the experts function plain local tensors, and transformers
selects it by name through the (wrapped) experts forward.
"""

from __future__ import annotations

from kernels import Mode

# Styles whose wrapper a replaced forward does not miss: "replicate" is the identity;
# "replicated_with_grad_allreduce" (Qwen3's q_norm/k_norm) only all-reduces parameter gradients,
# which training needs.
_TRANSPARENT_STYLES_IN_INFERENCE = {"replicate", "replicated_with_grad_allreduce"}
_TRANSPARENT_STYLES_IN_TRAINING = {"replicate"}


def _distributed_config(model):
    """The DistributedConfig `from_pretrained` sharded the model with; None for a model on one process."""
    return getattr(getattr(model, "config", None), "distributed_config", None)


def applied_plan(model) -> dict[str, str]:
    """The tensor- and expert-parallel styles transformers applied to `model`, by module pattern; {} if none."""
    config = _distributed_config(model)
    if config is None:
        return {}
    plan = dict(model.tp_plan) if config.tp_size > 1 else {}
    if config.ep_size > 1:
        plan.update(model.ep_plan)  # EP rules take precedence, as when transformers applies them
    return plan


def replacement_conflict(plan: dict[str, str], module_name: str, module, mode: Mode) -> str | None:
    """Why replacing `module_name`'s forward would lose what its plan style does in `mode`, or None.

    Only a style that wrapped the forward (an instance attribute `forward`) can be lost; hooks stay.
    """
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

    if "forward" not in vars(module):
        return None
    style = plan.get(replace_layer_number_by_wildcard(module_name))
    transparent = _TRANSPARENT_STYLES_IN_TRAINING if Mode.TRAINING in mode else _TRANSPARENT_STYLES_IN_INFERENCE
    if style is None or style in transparent:
        return None
    return f"its forward carries the parallel plan's {style!r} wrapper"


def uneven_attention_heads(model) -> str | None:
    """Why tensor parallelism cannot give every rank whole attention heads, or None if it can (or is off)."""
    config = _distributed_config(model)
    if config is None or config.tp_size == 1:
        return None
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    text_config = model.config.get_text_config(decoder=True)
    query_heads = text_config.num_attention_heads
    heads = {"query": query_heads, "key/value": getattr(text_config, "num_key_value_heads", None) or query_heads}
    uneven = [f"{count} {what}" for what, count in heads.items()
              if get_kv_heads_per_rank(model.tp_plan, count, config.tp_size) is None]
    if not uneven:
        return None
    return (f"tensor parallelism splits attention heads over tp_size={config.tp_size} ranks, but "
            f"{' and '.join(uneven)} heads do not divide by {config.tp_size}: a rank would hold part of a head, "
            "which no attention function (transformers' own included) can serve. Use a tp_size that divides "
            "both head counts, or keep attention whole with tp_plan overrides mapping the attention "
            "projections to 'replicate'.")
