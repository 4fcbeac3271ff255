"""binding.json -> docs/binding.md's "Cost per call" table: the CPU path's per-call cost, part by part."""

from __future__ import annotations


def plain_text(text: str) -> str:
    """`text` as markdown shows it: the parts name Python methods, whose `__` would otherwise turn to bold."""
    return text.replace("_", "\\_")


def cost_per_call(cpu: dict, load_average: float, cores: int) -> str:
    """The bare call, the op, the overhead and its parts, each marked with whether the TPU path pays it too."""
    per_call = cpu["per_call_us"]
    rows = [
        f"| per call, CPU, minimum over rounds (load average {load_average:.1f} on {cores} cores) | µs "
        "| also on the TPU path |",
        "| --- | ---: | --- |",
        f"| bare jitted call (JAX arrays, interpret mode) | {per_call['bare_jit']['min_us']:.1f} | |",
        f"| **op through the binding** | **{per_call['op']['min_us']:.1f}** | |",
        f"| **overhead** (target ≤ {cpu['target_us']:g}, stretch ≤ {cpu['stretch_target_us']:g}) "
        f"| **{cpu['overhead_us']:.1f}** | |",
    ]
    for part in cpu["breakdown_us"]:
        on_tpu_path = "yes" if part["also_on_tpu_path"] else "no"
        rows.append(f"| {plain_text(part['part'])} | {part['us']:.1f} | {on_tpu_path} |")
    rows.append(f"| unaccounted (noise, call glue) | {cpu['breakdown_unaccounted_us']:.1f} | |")
    # The race watch runs only inside the CPU kernel, so the TPU path never pays it.
    rows.append(f"| with race detection on (our tests): watching standard output "
                f"| {cpu['race_detection_extra_us']:.1f} | no |")
    return "\n".join(rows)


def tpu_path_python(tpu: dict) -> str:
    """The Python each op's call runs on TPU tensors (the launch stubbed out), beside the same op registered through
    torch_tpu's jax_op, and what it adds up to in a decode step, beside Hugging Face's measured step."""
    rows = ["| host Python per call on TPU tensors (launch stubbed out), minimum | µs | through `jax_op`, µs |",
            "| --- | ---: | ---: |"]
    rows += [f"| `{op}` | {figures['min_us']:.1f} | {tpu['per_call_us_through_jax_op'][op]['min_us']:.1f} |"
             for op, figures in tpu["per_call_us"].items()]
    step = tpu["decode_step_model"]
    rows += ["", "| decode step, eager | |", "| --- | ---: |",
             f"| kernel calls ({step['assumptions']}) | {step['kernel_calls_per_step']} |",
             f"| host Python, lower bound, ms | {step['host_ms_per_step_lower_bound']:.1f} |",
             f"| Hugging Face's measured step at batch 1, ms | {step['hf_step_ms_batch_1']:g} |",
             f"| share of that step | {100 * step['share_of_hf_step']:.0f} % |"]
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """binding.json's tables by section."""
    return {"cost-per-call": cost_per_call(data["cpu_path"], data["load_average_at_start"][0], data["cpu_count"]),
            "tpu-path": tpu_path_python(data["tpu_path_python"])}
