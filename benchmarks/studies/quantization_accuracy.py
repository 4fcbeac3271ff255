"""Quantization error of expert weights: kernelize(quantize_experts="int8" | "fp8" | "int4") against the float model.

For tiny Qwen3-MoE, Mixtral and GPT-OSS models built from config (float32,
seeded random weights; expert weights N(0, 0.02), transformers' usual
initializer range), with only the experts kernelized:

- quantized vs unquantized: the logits of one forward over a batch of seeded
  random prompts (max and mean absolute error, and the logits' own scale), and
  the greedy tokens of 32 new tokens per prompt (how many equal, and how many
  before the first that differs);
- teacher-forced: both models read the unquantized model's greedy sequence,
  and at each new position the quantized model's top token is compared with
  the unquantized one's. Free generation stops agreeing at the first
  difference; this counts every position on its own, and gives the
  unquantized model's margin (top-1 minus top-2 logit) where they differ,
  against its median margin: how close to a tie each difference was;
- kernel vs its reference: the same quantized model's logits against the
  eager float model whose expert weights are the dequantized ones. This is
  the kernel's own error, which tests/test_quantize.py asserts (<= 1e-4);
  here it shows how much of the first figure the kernel adds (nothing
  beyond float32 rounding).

float32 models, so that the error is the weights' quantization alone (no
bf16 rounding of activations on top). The kernels run in Pallas TPU
interpret mode on the CPU (exact, slow). Writes
benchmarks/results/quantization_accuracy.json (`--out`), building the kernel
from kernel_repos/ragged-dot-tpu (`--repo`), relative to the current directory.

    python -m benchmarks quantization_accuracy      (or python -m benchmarks.studies.quantization_accuracy)

The kernels take the tiles and paths of the generation they run for (off
TPU: TPU_KERNELS_GENERATION, recorded as `generation`). On TPU7x fp8 feeds
the fp8 MXU with fp8 activations, which adds their quantization error:

    TPU_KERNELS_GENERATION=tpu7x python -m benchmarks quantization_accuracy --schemes fp8 \
        --out benchmarks/results/quantization_accuracy_tpu7x.json
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch

from benchmarks.studies import kernel_repo, require_kernel_repo, result_path, write_json

KERNEL_REPO = kernel_repo("ragged-dot-tpu")
SCHEMES = ("int8", "fp8", "int4")
EXPERT_WEIGHT_STD = 0.02


def _models():
    from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig

    from tpu_kernels.integration.demo import tiny_qwen3_moe

    common = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=512)

    def from_config(config):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()

    return {
        "qwen3_moe (the demo's: H=128, I=64, 16 experts, top-4)": tiny_qwen3_moe,
        "mixtral (H=128, I=256, 8 experts, top-2)": lambda: from_config(
            MixtralConfig(**common, intermediate_size=256, num_local_experts=8, num_experts_per_tok=2)),
        "gpt_oss (H=128, I=128, 8 experts, top-2, biases, interleaved)": lambda: from_config(
            GptOssConfig(**common, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=16)),
    }


def _with_random_experts(model):
    """Expert weights as N(0, EXPERT_WEIGHT_STD) (some models leave them empty at init), seeded."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 3:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * EXPERT_WEIGHT_STD)
    return model


def _dequantized(float_model, quantized, kernel):
    from tpu_kernels.integration.kernelize import experts_modules

    reference = copy.deepcopy(float_model)
    for name in experts_modules(reference):
        module, source = reference.get_submodule(name), quantized.get_submodule(name)
        for projection in ("gate_up_proj", "down_proj"):
            weight = kernel.reference.dequantize_reference(
                getattr(source, projection), getattr(source, f"{projection}_scale_inv"),
                out_axis=2 if source.is_transposed else 1)
            getattr(module, projection).data = weight.float()
    return reference


def teacher_forced_agreement(reference_sequence_logits, sequence_logits, prompt_len: int) -> dict:
    """Top-token agreement at each new position of the unquantized model's greedy sequence, and the unquantized
    model's top-1 minus top-2 logit where the two disagree (module docstring)."""
    # Position p predicts token p + 1: the new tokens are predicted from prompt_len - 1 to the second to last.
    reference = reference_sequence_logits[:, prompt_len - 1 : -1].float()
    quantized = sequence_logits[:, prompt_len - 1 : -1].float()
    top2 = reference.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    differ = reference.argmax(-1) != quantized.argmax(-1)
    return {
        "teacher_forced_tokens_equal": f"{int((~differ).sum())}/{differ.numel()}",
        "teacher_forced_reference_margins_where_different": sorted(round(m, 6) for m in margin[differ].tolist()),
        "reference_median_margin": round(margin.median().item(), 6),
    }


def _run(model, prompt, new_tokens):
    with torch.no_grad():
        logits = model(prompt).logits
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    return logits, tokens


def accuracy_arguments(description: str, results_file: str) -> argparse.ArgumentParser:
    """The options of an accuracy report (this one, int4_granularity): the seeded prompts and where it writes."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--out", default=str(result_path(results_file)))
    return parser


def main(argv=None) -> int:
    parser = accuracy_arguments(__doc__, "quantization_accuracy.json")
    parser.add_argument("--repo", type=Path, default=KERNEL_REPO, help="the ragged-dot kernel repo")
    parser.add_argument("--schemes", nargs="+", choices=SCHEMES, default=list(SCHEMES))
    args = parser.parse_args(argv)
    require_kernel_repo(args.repo)

    from tpu_kernels import kernelize
    from tpu_kernels.distribution.builder import build_kernel_repo
    from tpu_kernels.integration.demo import quantization_error
    from tpu_kernels.distribution.loader import get_local_kernel
    from tpu_kernels.runtime.hardware import current_generation

    results = {
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "dtype": "float32",
        "expert_weight_std": EXPERT_WEIGHT_STD,
        "generation": current_generation(),
        "prompts": f"{args.batch} seeded random prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        build = build_kernel_repo(args.repo, Path(tmp))
        kernel = get_local_kernel(build, backend="cpu")
        repos = {"experts": str(build), "rmsnorm": None, "attention": None}
        for name, factory in _models().items():
            float_model = _with_random_experts(factory())
            prompt = torch.randint(0, float_model.config.vocab_size, (args.batch, args.prompt_len),
                                   generator=torch.Generator().manual_seed(0))
            reference_logits, reference_tokens = _run(float_model, prompt, args.new_tokens)
            with torch.no_grad():
                reference_sequence_logits = float_model(reference_tokens).logits
            rows = {}
            for scheme in args.schemes:
                model = kernelize(copy.deepcopy(float_model), repos=repos, quantize_experts=scheme)
                report = model.tpu_kernels_report.quantization
                logits, tokens = _run(model, prompt, args.new_tokens)
                with torch.no_grad():
                    dequantized_logits = _dequantized(float_model, model, kernel)(prompt).logits
                    sequence_logits = model(reference_tokens).logits
                rows[scheme] = {
                    **quantization_error(reference_logits, logits, reference_tokens, tokens, args.prompt_len),
                    **teacher_forced_agreement(reference_sequence_logits, sequence_logits, args.prompt_len),
                    "kernel_vs_dequantized_reference_logits_max_abs_error":
                        (logits - dequantized_logits).abs().max().item(),
                    "expert_bytes_before": report.bytes_before,
                    "expert_bytes_after": report.bytes_after,
                    "experts_modules_quantized": len(report.quantized),
                }
                row = rows[scheme]
                print(f"{name[:10]:<10} {scheme}: logits max {row['logits_max_abs_error']:.3e} "
                      f"mean {row['logits_mean_abs_error']:.3e} (|logits| <= {row['logits_max_abs']:.2f}), "
                      f"greedy {row['greedy_tokens_equal']}, teacher-forced {row['teacher_forced_tokens_equal']}, "
                      f"kernel vs dequantized "
                      f"{row['kernel_vs_dequantized_reference_logits_max_abs_error']:.1e}, bytes "
                      f"{report.bytes_before} -> {report.bytes_after}", flush=True)
            results["models"][name] = rows
    out = write_json(args.out, results, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
