"""`tpu-kernels demo`: the whole chain on one machine, then the same on a TPU VM.

Default (no --hub): build the kernel repos, start a local Hub in a temp dir,
publish the builds to it through huggingface_hub, then in a fresh process
pointed at that Hub (HF_ENDPOINT is read when huggingface_hub is imported):
`get_kernel`, a tiny Qwen3-MoE from config, greedy generation with and without
`kernelize`, and a table. Exit code 0 only if every kind of layer (experts,
RMSNorm, attention) was replaced and the tokens are identical.

With `--quantize-experts int8|fp8|int4` the experts are kernelized with
quantized weights: the demo prints their error against the unquantized model
(logits, greedy tokens) and the bytes saved, and exits 0 if every kind was replaced
and every experts module quantized (the tokens may then differ).

With `--hub URL --model ID --device tpu` the second half runs against a real
Hub and checkpoint on a TPU VM.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

DEMO_ORG = "tpu-kernels"
KERNEL_REPOS = Path(__file__).resolve().parents[2] / "kernel_repos"
DEMO_TOKEN = "demo-write-token"


def _publish_to_local_hub(workdir: Path, repos: list[Path]) -> tuple[object, list[str]]:
    from ..distribution.builder import build_kernel_repo
    from ..distribution.hub.server import start_hub
    from ..distribution.publish import upload_kernel

    hub = start_hub(workdir / "hub", token=DEMO_TOKEN, trusted_orgs=[DEMO_ORG])
    published = []
    for repo in repos:
        built = build_kernel_repo(repo, workdir / "build")
        publication = upload_kernel(built, f"{DEMO_ORG}/{built.name}", endpoint=hub.url, token=DEMO_TOKEN)
        published.append(f"{DEMO_ORG}/{built.name}@{publication.branch[1:]}")
        print(f"published {published[-1]} to the local Hub at {hub.url}")
    return hub, published


def tiny_qwen3_moe():
    """A 2-layer Qwen3-MoE from config (16 experts, top-4), seeded: the demo's and the benchmarks' model."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def quantization_error(reference_logits, logits, reference_tokens, tokens, prompt_len: int) -> dict:
    """How far a quantized model's outputs are from the unquantized model's: logits and greedy tokens."""
    difference = (logits.float() - reference_logits.float()).abs()
    generated = tokens[:, prompt_len:] == reference_tokens[:, prompt_len:]
    # Per sequence, the new tokens before the first that differs.
    agreeing = generated.int().cumprod(dim=1).sum(dim=1)
    return {
        "logits_max_abs_error": difference.max().item(),
        "logits_mean_abs_error": difference.mean().item(),
        "logits_max_abs": reference_logits.float().abs().max().item(),
        "greedy_tokens_equal": f"{int(generated.sum())}/{generated.numel()}",
        "greedy_tokens_before_first_difference": agreeing.tolist(),
    }


def load_model(model_id: str | None, device: str):
    if model_id is None:
        return tiny_qwen3_moe().to(device), None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16).to(device).eval()
    return model, AutoTokenizer.from_pretrained(model_id)


def _generate(model, prompt, new_tokens: int):
    import torch

    with torch.no_grad():
        model.generate(prompt, max_new_tokens=2, do_sample=False)  # warm-up: compilation is not a token
        start = time.perf_counter()
        tokens = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
    return tokens, seconds / new_tokens


def _silence_notices_a_demo_reader_cannot_act_on(args) -> None:
    """Third-party notices printed on every run, none about this demo's result; set before torch is imported."""
    # libtpu's and XLA's INFO lines ("GetPjrtApi was found for TPU ..."); their warnings and errors still print.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # torch's own torch.utils.mkldnn, at `import torch`.
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning)
    if args.device == "cpu":
        # torch_tpu's advice for TPU hosts' allocator, on a CPU run where torch_tpu runs nothing.
        warnings.filterwarnings("ignore", message=r"<TorchTpu/Performance/TcMalloc/>", category=UserWarning)
    if args.model is None:
        # The only downloads are the kernels, a few small files each: no progress to watch.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def run_model_part(args) -> int:
    """kernelize + generate; HF_ENDPOINT already points at the Hub to use."""
    _silence_notices_a_demo_reader_cannot_act_on(args)
    import torch

    from .kernelize import kernelize

    model, tokenizer = load_model(args.model, args.device)
    if tokenizer is not None:
        prompt = tokenizer(["The capital of France is"], return_tensors="pt").input_ids.to(args.device)
    else:
        prompt = torch.randint(0, model.config.vocab_size, (args.batch, 8), generator=torch.Generator().manual_seed(0))
    eager_tokens, eager_seconds = _generate(model, prompt, args.new_tokens)
    if args.quantize_experts:
        with torch.no_grad():
            eager_logits = model(prompt).logits
    kernelize(model, device=args.device, repos=dict(r.split("=", 1) for r in args.repo),
              quantize_experts=args.quantize_experts)
    report = model.tpu_kernels_report
    print(repr(report))
    print()
    kept = [entry.kind for entry in report.entries if not entry.replaced]
    if kept:
        print(f"FAILED: not replaced: {', '.join(kept)} (the demo asks for every kind)")
        return 1
    ours_tokens, ours_seconds = _generate(model, prompt, args.new_tokens)

    print(f"{'':<26}{'eager':>12}{'kernelized':>14}")
    print(f"{'ms per token':<26}{eager_seconds * 1e3:>12.1f}{ours_seconds * 1e3:>14.1f}")
    if args.device == "cpu":
        print("(on the CPU the kernels run in TPU interpret mode: exact, and far slower than eager by design)")
    if args.quantize_experts:
        with torch.no_grad():
            logits = model(prompt).logits
        return _print_quantization(report.quantization, quantization_error(
            eager_logits.cpu(), logits.cpu(), eager_tokens.cpu(), ours_tokens.cpu(), prompt.shape[1]))
    identical = torch.equal(eager_tokens.cpu(), ours_tokens.cpu())
    print(f"{'greedy tokens identical':<26}{'yes' if identical else 'NO':>26}")
    return 0 if identical else 1


def _print_quantization(quantization, error: dict) -> int:
    """The quantized experts' error against the unquantized model and the bytes saved; 0 if all were quantized."""
    before, after = quantization.bytes_before, quantization.bytes_after
    print(f"quantized experts ({quantization.scheme}) against the unquantized eager model:")
    print(f"  logits max abs error     {error['logits_max_abs_error']:.3e}  (largest |logit| {error['logits_max_abs']:.3f})")
    print(f"  logits mean abs error    {error['logits_mean_abs_error']:.3e}")
    print(f"  greedy tokens equal      {error['greedy_tokens_equal']} "
          f"(before the first difference, per prompt: {error['greedy_tokens_before_first_difference']})")
    print(f"  expert weights           {before / 1e6:.3f} MB -> {after / 1e6:.3f} MB with scales, "
          f"{(before - after) / 1e6:.3f} MB saved ({1 - after / max(before, 1):.1%})")
    if quantization.kept or not quantization.quantized:
        print(f"FAILED: experts not quantized: {quantization.kept or 'none found'}")
        return 1
    return 0


def demo_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpu-kernels demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hub", help="Hub endpoint (default: a local Hub started here)")
    parser.add_argument("--model", help="checkpoint id (default: a tiny Qwen3-MoE from config)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "tpu"])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2, help="prompts per batch for the tiny model")
    parser.add_argument("--repo", action="append", default=[], metavar="KIND=ORG/NAME@V",
                        help="override the kernel repo of a kind, e.g. experts=org/ragged-dot-tpu@1")
    parser.add_argument("--quantize-experts", choices=["int8", "fp8", "int4"],
                        help="kernelize with quantized expert weights; prints their error and the bytes saved")
    parser.add_argument("--model-part", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model_part or args.hub:
        if args.hub:
            os.environ["HF_ENDPOINT"] = args.hub
        return run_model_part(args)

    repos = sorted(p.parent for p in KERNEL_REPOS.glob("*/build.toml"))
    with tempfile.TemporaryDirectory(prefix="tpu-kernels-demo-") as tmp:
        workdir = Path(tmp)
        hub, published = _publish_to_local_hub(workdir, repos)
        try:
            env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN=DEMO_TOKEN, KERNELS_CACHE=str(workdir / "cache"),
                       JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
            command = [sys.executable, "-m", "tpu_kernels.cli", "demo", "--model-part", "--device", args.device,
                       "--new-tokens", str(args.new_tokens), "--batch", str(args.batch)]
            for override in args.repo:
                command += ["--repo", override]
            if args.quantize_experts:
                command += ["--quantize-experts", args.quantize_experts]
            return subprocess.call(command, env=env)
        finally:
            hub.stop()
