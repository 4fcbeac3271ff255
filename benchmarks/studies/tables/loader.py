"""loader.json -> docs/hub.md's table: loading a kernel from a local Hub, ours against unmodified `kernels`."""

from __future__ import annotations


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def loads(data: dict) -> str:
    """Cold, warm, repeated and offline loads: each loader's median time and requests, and ours over theirs."""
    environment = data["environment"]
    rows = [f"| {data['kernel']} ({data['variant']}, {data['files_in_variant']} files), median of {data['runs']} "
            f"runs; kernels {environment['kernels']}, huggingface_hub {environment['huggingface_hub']}, "
            f"{environment['cpus']} cores | ours ms | kernels ms | ours / kernels (paired) | requests, ours / kernels |",
            "| --- | ---: | ---: | ---: | --- |"]
    for state, what in (("cold", "cold: empty cache, new process"), ("warm", "warm: cached, new process")):
        load = data[state]
        rows.append(f"| {what} | {ms(load['ours']['median_s'])} | {ms(load['kernels']['median_s'])} "
                    f"| {load['median_paired_ratio']:.2f} "
                    f"| {load['ours']['requests_per_load']:g} / {load['kernels']['requests_per_load']:g} |")
    repeat = data["repeat_in_process"]
    requests = repeat["requests_per_load"]
    rows.append(f"| again in the same process ({repeat['calls_per_loader']} calls) | {ms(repeat['ours']['median_s'])} "
                f"| {ms(repeat['kernels']['median_s'])} | {repeat['ratio_ours_over_kernels']:.2f} "
                f"| {requests['ours']['requests']:g} / {requests['kernels']['requests']:g} |")
    offline = data["offline"]
    theirs = offline["kernels"]
    theirs_cell = ms(theirs["median_s"]) if isinstance(theirs, dict) else "refuses: " + theirs.split(":")[0]
    rows.append(f"| offline (`HF_HUB_OFFLINE=1`, cached) | {ms(offline['ours']['median_s'])} | {theirs_cell} | "
                f"| {offline['ours']['requests_per_load']:g} / not counted |")
    rows.append(f"| of which: the cached files' digest check | {ms(data['digest_check_median_s'])} | | | |")
    rows.append(f"| of which: digest check and private copy | {ms(data['digest_check_and_private_copy_median_s'])} "
                "| | | |")
    return "\n".join(rows)


def render_markdown(data: dict) -> dict[str, str]:
    """loader.json's table by section."""
    return {"loads": loads(data)}
