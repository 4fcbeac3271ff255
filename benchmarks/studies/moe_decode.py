"""Per-step decode time of a MoE model: kernelized vs eager vs transformers' grouped_mm.

On this CPU the kernelized model runs the Pallas kernels in TPU interpret mode,
so it is expected to be far slower than eager: the point here is the harness,
which a TPU VM runs unchanged to reproduce the published table (batch 1..64,
ms/step, tokens/s):

    tpu-kernels bench moe_decode --device tpu --model Qwen/Qwen3-30B-A3B

Method: for each implementation and batch size, prefill a seeded random prompt
of --prompt-len tokens, then time --steps greedy decode steps one by one
(each step ends with the next tokens copied to the host, which waits for the
device), after --warmup untimed steps (compilation is not a step). Reports the
median ms/step and tokens/s = batch / median. Writes JSON (and a PNG plot of
ms/step against batch size) to benchmarks/results/ (`--out`). Off the TPU the
kernels are built from --kernel-repos (default kernel_repos/); both paths are
relative to the current directory. `python -m benchmarks.studies.moe_decode` is
the same.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.studies import KERNEL_REPOS_DIR, require_kernel_repo, result_path, write_json

KINDS_TO_REPOS = {"experts": "ragged-dot-tpu", "rmsnorm": "rmsnorm-tpu", "attention": "attention-tpu"}


def decode_step_times(model, batch: int, prompt_len: int, steps: int, warmup: int, device: str) -> list[float]:
    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=generator).to(device)
    times = []
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        past, tokens = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for step in range(warmup + steps):
            start = time.perf_counter()
            out = model(tokens, past_key_values=past, use_cache=True)
            past, tokens = out.past_key_values, out.logits[:, -1:].argmax(-1)
            tokens.cpu()  # waits for the device
            if step >= warmup:
                times.append(time.perf_counter() - start)
    return times


def prepare(implementation: str, args, workdir: Path):
    """A fresh model set up for one implementation."""
    from tpu_kernels.integration.demo import load_model

    model, _ = load_model(args.model, args.device)
    if implementation in ("eager", "grouped_mm"):
        model.set_experts_implementation(implementation)
        return model
    from tpu_kernels import kernelize

    kinds = args.kinds.split(",")
    if args.device == "tpu":
        repos = {kind: (f"{args.org}/{KINDS_TO_REPOS[kind]}@1" if kind in kinds else None) for kind in KINDS_TO_REPOS}
    else:
        from tpu_kernels.distribution.builder import build_kernel_repo

        repos = {
            kind: (str(build_kernel_repo(args.kernel_repos / repo, workdir)) if kind in kinds else None)
            for kind, repo in KINDS_TO_REPOS.items()
        }
    kernelize(model, device=args.device, repos=repos, use_fallback=False)
    return model


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for implementation, rows in results["implementations"].items():
        axis.plot([r["batch"] for r in rows], [r["median_ms_per_step"] for r in rows], marker="o", label=implementation)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("batch size (sequences decoded per step)")
    axis.set_ylabel("median ms / decode step")
    axis.set_title(f"{results['model']} on {results['device']}")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "tpu"])
    parser.add_argument("--model", help="checkpoint id (default: a tiny Qwen3-MoE from config)")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--implementations", default="eager,grouped_mm,kernelized")
    parser.add_argument("--kinds", default="experts", help="what kernelize replaces (experts,rmsnorm,attention)")
    parser.add_argument("--org", default="tpu-kernels", help="Hub org of the kernels on TPU")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=str(result_path("moe_decode.json")))
    parser.add_argument("--kernel-repos", type=Path, default=KERNEL_REPOS_DIR,
                        help="folder of the kernel repos built off the TPU (default: kernel_repos)")
    args = parser.parse_args(argv)
    if args.device != "tpu" and "kernelized" in args.implementations.split(","):
        for kind in args.kinds.split(","):
            require_kernel_repo(args.kernel_repos / KINDS_TO_REPOS[kind], option="--kernel-repos")

    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = {
        "model": args.model or "tiny Qwen3-MoE (2 layers, H=128, 16 experts, top-4)",
        "device": args.device,
        "host": platform.processor() or platform.machine(),
        "kernelized_kinds": args.kinds,
        "method": "median over --steps greedy decode steps after --warmup untimed ones; KV cache on",
        "note": "on the CPU the kernels run in Pallas TPU interpret mode (exact, slow by design)"
        if args.device == "cpu" else "",
        "implementations": {},
        # Other work on the host skews CPU timings: the load average says how busy it was.
        "load_average_at_start": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for implementation in args.implementations.split(","):
            model = prepare(implementation, args, Path(tmp))
            rows = []
            for batch in batches:
                times = decode_step_times(model, batch, args.prompt_len, args.steps, args.warmup, args.device)
                median = statistics.median(times)
                rows.append({"batch": batch, "median_ms_per_step": median * 1e3, "tokens_per_s": batch / median})
                print(f"{implementation:<11} batch {batch:>3}: {median * 1e3:9.2f} ms/step  {batch / median:9.1f} tok/s")
            results["implementations"][implementation] = rows
    results["load_average_at_end"] = os.getloadavg()
    out = write_json(args.out, results, indent=2)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
