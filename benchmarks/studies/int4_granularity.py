"""int4 scale granularity: would grouped scales bring int4 experts to the float model's greedy tokens?

The accuracy report (`quantization_accuracy`) gives int4 with one scale per
output channel. This asks, before any kernel reads grouped scales, what they
would buy: on the report's tiny models, seeded as it seeds them, each experts
module's weights are replaced by their int4 round trip (quantize, then
dequantize in float32) and the eager float model runs greedy decoding. The
int4 codes and scales come from kernelize's own quantizer
(`integration.quantize.int4_codes`: symmetric, the least-squared-error
clipping ratio) applied per output channel, or per group of `g` consecutive
weights along the contraction (each group its own scale). No kernel runs:
the kernels reproduce the dequantized model to float32 rounding (the report's
`kernel_vs_dequantized_reference_logits_max_abs_error`), so the per-channel
rows here must equal the report's int4 rows, and the int8 row is the
control. Writes benchmarks/results/int4_granularity.json (`--out`).

    python -m benchmarks int4_granularity
"""

from __future__ import annotations

import copy

import torch

from benchmarks.studies import write_json
from benchmarks.studies.quantization_accuracy import (
    EXPERT_WEIGHT_STD, _models, _run, _with_random_experts, accuracy_arguments,
)

GROUP_SIZES = (128, 64, 32)
PROJECTIONS = ("gate_up_proj", "down_proj")


def int4_round_trip(weight: torch.Tensor, out_axis: int, group: int | None) -> torch.Tensor:
    """`weight[E, D1, D2]` through int4 and back (float32), one scale per output channel (`group` None) or per
    `group` consecutive weights of a channel's contraction (which `group` must divide, unless it is at least the
    contraction: then the channel is one group)."""
    from tpu_kernels.integration.quantize import int4_codes

    # Contraction last: [E, out, K]; a group is then a channel of its own, [E, out x K / group, group].
    values = weight.detach().float()
    channels = values if out_axis == 1 else values.transpose(1, 2)
    experts, outs, contraction = channels.shape
    group = min(group or contraction, contraction)
    if contraction % group:
        raise ValueError(f"a group of {group} does not divide the contraction's {contraction}")
    grouped = channels.reshape(experts, outs * contraction // group, group)
    codes, scale_inv = int4_codes(grouped, out_axis=1)
    round_trip = (codes.float() * scale_inv.unsqueeze(2)).reshape(experts, outs, contraction)
    return round_trip if out_axis == 1 else round_trip.transpose(1, 2)


def int8_round_trip(weight: torch.Tensor, out_axis: int) -> torch.Tensor:
    from tpu_kernels.integration.quantize import quantize_int8

    codes, scale_inv = quantize_int8(weight, out_axis)
    return codes.float() * scale_inv.unsqueeze(3 - out_axis)


def with_round_trip(float_model, round_trip):
    from tpu_kernels.integration.kernelize import experts_modules

    model = copy.deepcopy(float_model)
    for name in experts_modules(model):
        module = model.get_submodule(name)
        out_axis = 2 if getattr(module, "is_transposed", False) else 1
        for projection in PROJECTIONS:
            parameter = getattr(module, projection)
            parameter.data = round_trip(parameter, out_axis)
    return model


def variants() -> dict:
    rows = {"int8 per channel": int8_round_trip, "int4 per channel": lambda w, axis: int4_round_trip(w, axis, None)}
    for group in GROUP_SIZES:
        rows[f"int4 groups of {group}"] = lambda w, axis, group=group: int4_round_trip(w, axis, group)
    return rows


def main(argv=None) -> int:
    args = accuracy_arguments(__doc__, "int4_granularity.json").parse_args(argv)

    from tpu_kernels.integration.demo import quantization_error

    results = {
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "expert_weight_std": EXPERT_WEIGHT_STD,
        "prompts": f"{args.batch} seeded random prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens",
        "models": {},
    }
    for name, factory in _models().items():
        float_model = _with_random_experts(factory())
        prompt = torch.randint(0, float_model.config.vocab_size, (args.batch, args.prompt_len),
                               generator=torch.Generator().manual_seed(0))
        reference_logits, reference_tokens = _run(float_model, prompt, args.new_tokens)
        rows = {}
        for variant, round_trip in variants().items():
            logits, tokens = _run(with_round_trip(float_model, round_trip), prompt, args.new_tokens)
            error = quantization_error(reference_logits, logits, reference_tokens, tokens, args.prompt_len)
            rows[variant] = {key: error[key] for key in
                             ("logits_max_abs_error", "logits_mean_abs_error", "greedy_tokens_equal",
                              "greedy_tokens_before_first_difference")}
            print(f"{name[:10]:<10} {variant:<20} greedy {error['greedy_tokens_equal']:>5}, logits max "
                  f"{error['logits_max_abs_error']:.3e} mean {error['logits_mean_abs_error']:.3e}", flush=True)
        results["models"][name] = rows
    out = write_json(args.out, results, indent=2, sort_keys=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
