"""One (model, call, generation): every path's terms and time, the latent cache's floor, the forms' pick and the
rule's."""

from __future__ import annotations

import importlib

from benchmarks import perf
from benchmarks.perf.chip import as_generation
from benchmarks.studies.moe_layer import modelling

from . import kernels, programs
from .shapes import Call, MlaModel, absorbed_flops, latent_cache_bytes

FORMS = ("absorbed", "expanded")


def floor(model: MlaModel, call: Call, generation: str) -> dict:
    """The latent cache read once, at the fitted HBM share and at the peak."""
    gen = as_generation(generation)
    cache = latent_cache_bytes(model, call)
    share = perf.FITTED_RATES.hbm_fraction(generation)
    return {"latent_bytes": cache, "us": cache / (gen.device_hbm_bytes_per_s * share) * 1e6,
            "at_peak_us": cache / gen.device_hbm_bytes_per_s * 1e6,
            "absorbed_mxu_us": absorbed_flops(model, call) / gen.device_bf16_flops_per_s * 1e6}


class XlaTerms:
    """Each distinct program of a case compiled once per generation (on the compile pool), priced on demand."""

    def __init__(self, compiler):
        self.compiler, self.futures = compiler, {}

    def submit(self, key: tuple, program: programs.Program, generation: str) -> None:
        if (key, program.name, generation) not in self.futures:
            self.futures[(key, program.name, generation)] = self.compiler.submit(
                program.fn, list(program.avals), generation, kind="mla XLA programs")

    def term(self, key: tuple, program: programs.Program, generation: str) -> dict:
        compiled = self.futures[(key, program.name, generation)].result()
        if isinstance(compiled, dict):
            return {"term": program.name, "us": float("nan"), "error": compiled.get("error")}
        found = modelling.price(compiled, perf.ProgramReplay((), ()))
        return {"term": program.name, "us": found.pipelined_time_s * 1e6, "hbm_bytes": found.xla_hbm_bytes,
                "flops": found.xla_flops, "priced_by": "XLA program, perf.program_time"}


def path(terms: list[dict]) -> dict:
    """A path's terms and total; NaN (and the first error) where a term is not priced."""
    errors = [t["error"] for t in terms if "error" in t]
    total = sum(t["us"] for t in terms) if not errors else float("nan")
    return {"us": total, "terms": terms, **({"error": errors[0]} if errors else {})}


def kernel_term(name: str, found: dict) -> dict:
    if "error" in found:
        return {"term": name, "us": float("nan"), "error": found["error"]}
    return {"term": name, "priced_by": "grid replay, calibrated pipelined figure", **found}


def with_band(found: dict, kernel: dict) -> dict:
    """A path's band: its kernel's calibrated p90 band around the kernel, the XLA terms (no calibrated error) as
    priced."""
    band = kernel.get("band_p90_us")
    if band is None or "error" in found:
        return {**found, "band_p90_us": None}
    rest = found["us"] - kernel["us"]
    return {**found, "band_p90_us": [rest + band[0], rest + band[1]]}


def rule_module(built):
    """The kernel's own choice between the forms (`attention_tpu.mla`), or the error importing it."""
    try:
        return importlib.import_module(f"{built.__name__}.mla")
    except Exception as error:  # noqa: BLE001 - a build without the rule is a result
        return error


def rule_pick(rule, built, model: MlaModel, call: Call, generation: str) -> dict:
    if isinstance(rule, Exception):
        said = str(rule).splitlines()[0].replace(built.__name__, "attention_tpu")  # not the build's hashed name
        return {"pick": None, "why": f"no rule in this build: {type(rule).__name__}: {said}"}
    hardware = importlib.import_module(f"{built.__name__}._hardware")
    shape = rule.LatentShape(heads=model.heads, nope=model.nope, rope=model.rope, v=model.v, latent=model.latent,
                             batch=call.batch, q_len=call.q_len, kv_len=call.kv_len, itemsize=2)
    absorbed = rule.absorbed_is_cheaper(shape, hardware.resolve_target(generation))
    return {"pick": "absorbed" if absorbed else "expanded",
            "roofline_us": {form: rule.roofline_seconds(*work, hardware.resolve_target(generation)) * 1e6
                            for form, work in rule.form_costs(shape, hardware.resolve_target(generation)).items()}}


def submit_case(xla: XlaTerms, model: MlaModel, call: Call, generation: str) -> None:
    key = (model.key, call)
    for program in (programs.transformers_programs(model, call) + programs.absorbed_programs(model, call)
                    + programs.expanded_programs(model, call)):
        xla.submit(key, program, generation)


def measure(built, rule, xla: XlaTerms, model: MlaModel, call: Call, generation: str, rival=None) -> dict:
    """The row of one (model, call, generation); `rival(...)`: vLLM's kernel's figures, or None."""
    key = (model.key, call)
    found_floor = floor(model, call, generation)
    latent = kernels.latent_kernel(built, model, call, generation, found_floor["latent_bytes"])
    flash = kernels.flash_kernel(built, model, call, generation)
    transformers = path([xla.term(key, p, generation) for p in programs.transformers_programs(model, call)])
    absorbed_xla = [xla.term(key, p, generation) for p in programs.absorbed_programs(model, call)]
    absorbed = with_band(path([absorbed_xla[0], kernel_term("latent kernel", latent), absorbed_xla[1]]), latent)
    expanded = with_band(path([xla.term(key, p, generation) for p in programs.expanded_programs(model, call)]
                              + [kernel_term("flash kernel", flash)]), flash)
    priced = {form: found["us"] for form, found in (("absorbed", absorbed), ("expanded", expanded))
              if found["us"] == found["us"]}
    row = {"model": model.key, "call": call.label, "kind": call.kind, "batch": call.batch, "q_len": call.q_len,
           "kv_len": call.kv_len, "generation": generation, "floor": found_floor, "transformers": transformers,
           "absorbed": absorbed, "expanded": expanded,
           "model_pick": min(priced, key=priced.get) if len(priced) == len(FORMS) else None,
           "rule": rule_pick(rule, built, model, call, generation)}
    if row["model_pick"]:
        row["ours_us"] = priced[row["model_pick"]]
        row["rule_agrees"] = None if row["rule"]["pick"] is None else row["rule"]["pick"] == row["model_pick"]
    if rival is not None:
        row["vllm_mla"] = rival(model, call, generation, absorbed_xla)
    return row
