"""The suites `kernels benchmark tpu-kernels/ragged-dot-tpu --version 1` runs (through the repo's
benchmarks/benchmark.py): the experts layers and grouped matmuls we model, and the microbenchmarks of the
performance model's constants (`model_constant_suites`).

On a TPU host the cases are the shapes `tpu-kernels check` compiles (the kernel's `compile_targets`): the experts
layers of Qwen3-30B-A3B (one chip and one rank of eight), Gemma 4 26B-A4B and GPT-OSS-20B (one chip and one
rank of eight) at decode and prefill token counts (Gemma's prefill at Qwen3's 2048 tokens), and the grouped
matmuls of Qwen3's and Gemma 4's projections at a decode batch's rows. Without a TPU, small shapes in interpret
mode. `_benchmark_harness.py` (shipped into every build) says how a case is timed and checked.

Each case checks its output against the kernel's float64 reference (`reference`), computed once on the host
(at prefill sizes that takes minutes on a TPU VM's host). Routing is uniform at random; weights are scaled so
that outputs stay below 2, where bfloat16's rounding stays within the runner's absolute tolerance of 0.01.
`python -m benchmarks calibrate --from-benchmark` (the tpu-kernels checkout's lab) reads these tables and input
builders to price each case with its performance model.
"""

import torch

from . import _benchmark_harness as harness
from . import model_constant_suites

# Experts layers: class -> workload -> (the layer's name in compile_targets.LAYERS, tokens).
LAYER_CASES = {
    "Qwen3_30B_A3B": {"ep1_decode_t1": ("qwen3-30b-a3b EP1", 1), "ep1_decode_t256": ("qwen3-30b-a3b EP1", 256),
                      "ep1_prefill_t2048": ("qwen3-30b-a3b EP1", 2048), "ep8_decode_t256": ("qwen3-30b-a3b EP8", 256)},
    "Gemma4_26B_A4B": {"decode_t256": ("gemma-4-26b-a4b", 256), "prefill_t2048": ("gemma-4-26b-a4b", 2048)},
    "GptOss20B": {"ep1_decode_t1": ("gpt-oss-20b EP1", 1), "ep1_prefill_t2048": ("gpt-oss-20b EP1", 2048),
                  "ep8_decode_t64": ("gpt-oss-20b EP8", 64)},
}
# Grouped matmuls: class -> workload -> (the model's name in compile_targets.GROUPED, projection).
MATMUL_CASES = {
    "GroupedMatmul": {"qwen3_gate_up_m512": ("qwen3-30b-a3b", "gate_up"), "qwen3_down_m512": ("qwen3-30b-a3b", "down"),
                      "gemma4_gate_up_m512": ("gemma-4-26b-a4b", "gate_up"),
                      "gemma4_down_m512": ("gemma-4-26b-a4b", "down")},
}
# Without a TPU: small layers in compile_targets.LAYERS' form (experts, hidden, intermediate, top-k, layout, gate).
INTERPRET_LAYERS = {
    "small silu": (4, 128, 128, 2, dict(weights_transposed=False), dict(activation="silu")),
    "small clamped swiglu": (4, 128, 128, 2, dict(weights_transposed=True), dict(
        activation="clamped_swiglu", interleaved=True, alpha=1.702, limit=7.0)),
}
INTERPRET_LAYER_CASES = {"InterpretModeExpertsLayer": {"silu_t8": ("small silu", 8),
                                                       "clamped_swiglu_t8": ("small clamped swiglu", 8)}}
INTERPRET_GROUPED = {"small": dict(experts=4, hidden=128, intermediate=128, rows=(32,))}
INTERPRET_MATMUL_CASES = {"InterpretModeGroupedMatmul": {"gate_up_m32": ("small", "gate_up")}}


def layer_shapes(compile_targets) -> dict:
    """Every experts layer a case names: the kernel's modelled ones and the small interpret-mode ones."""
    return {name: entry[:6] for name, entry in compile_targets.LAYERS.items()} | INTERPRET_LAYERS


def grouped_shapes(compile_targets) -> dict:
    """Every grouped matmul a case names: the models compile_targets runs it at, and the small interpret-mode one."""
    modelled = {model: dict(experts=compile_targets.MODELS[model]["experts"], hidden=compile_targets.MODELS[model]["hidden"],
                            intermediate=compile_targets.MODELS[model]["intermediate"], rows=compile_targets.GROUPED_ROWS)
                for model in compile_targets.GROUPED}
    return modelled | INTERPRET_GROUPED


def layer_inputs(shape, tokens: int, generator: torch.Generator) -> dict:
    """The experts layer's arguments on the CPU: hidden states, distinct top-k picks, softmax routing weights,
    weights in the layer's layout (biases with the clamped SwiGLU gate) and the gate's options."""
    experts, hidden, intermediate, top_k, layout, gate = shape

    def normal(*size, scale=1.0):
        return (scale * torch.randn(*size, generator=generator)).to(torch.bfloat16)

    transposed = layout["weights_transposed"]
    gate_up = (experts, hidden, 2 * intermediate) if transposed else (experts, 2 * intermediate, hidden)
    down = (experts, intermediate, hidden) if transposed else (experts, hidden, intermediate)
    biased = gate["activation"] == "clamped_swiglu"
    return dict(
        hidden_states=normal(tokens, hidden),
        top_k_index=torch.rand(tokens, experts, generator=generator).argsort(-1)[:, :top_k].to(torch.int32),
        top_k_weights=torch.softmax(torch.randn(tokens, top_k, generator=generator), -1).to(torch.bfloat16),
        gate_up_proj=normal(*gate_up, scale=hidden ** -0.5), down_proj=normal(*down, scale=0.5 * intermediate ** -0.5),
        gate_up_bias=normal(experts, 2 * intermediate, scale=0.1) if biased else None,
        down_bias=normal(experts, hidden, scale=0.1) if biased else None,
        options=dict(layout, **gate),
    )


def matmul_inputs(shape: dict, projection: str, generator: torch.Generator) -> dict:
    """A projection's grouped matmul on the CPU: rows spread over the experts at random, weights `[E, N, K]`."""
    rows, experts = shape["rows"][0], shape["experts"]
    k, n = ((shape["hidden"], 2 * shape["intermediate"]) if projection == "gate_up"
            else (shape["intermediate"], shape["hidden"]))
    picks = torch.randint(0, experts, (rows,), generator=generator)
    return dict(lhs=torch.randn(rows, k, generator=generator).to(torch.bfloat16),
                rhs=(0.3 * k ** -0.5 * torch.randn(experts, n, k, generator=generator)).to(torch.bfloat16),
                group_sizes=torch.bincount(picks, minlength=experts).to(torch.int32))


def _layer_arguments(inputs) -> tuple:
    """The positional arguments the kernel's experts layer and its reference both take, in their order."""
    return tuple(inputs[name] for name in ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj",
                                           "down_proj", "gate_up_bias", "down_bias"))


class ExpertsLayerCase(harness.KernelCase):
    def spec(self, case, targets):
        name, tokens = case
        return layer_shapes(targets)[name], tokens

    def make_inputs(self, spec, generator):
        return layer_inputs(*spec, generator)

    def call(self, inputs):
        return self.kernel.gated_experts(*_layer_arguments(inputs), **inputs["options"])

    def expected(self, inputs):
        return self.kernel.reference.gated_experts_reference(*_layer_arguments(inputs), **inputs["options"])


class GroupedMatmulCase(harness.KernelCase):
    def spec(self, case, targets):
        model, projection = case
        return grouped_shapes(targets)[model], projection

    def make_inputs(self, spec, generator):
        return matmul_inputs(*spec, generator)

    def call(self, inputs):
        return self.kernel.ragged_dot(inputs["lhs"], inputs["rhs"], inputs["group_sizes"], transpose_rhs=True)

    def expected(self, inputs):
        return self.kernel.reference.ragged_dot_reference(inputs["lhs"], inputs["rhs"], inputs["group_sizes"],
                                                          transpose_rhs=True)


SUITES = [(ExpertsLayerCase, LAYER_CASES, INTERPRET_LAYER_CASES),
          (GroupedMatmulCase, MATMUL_CASES, INTERPRET_MATMUL_CASES), *model_constant_suites.SUITES]
