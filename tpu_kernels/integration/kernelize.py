"""kernelize(model): point a transformers model's layers at our TPU kernels in one call.

Kinds of layer and how each is replaced:

* experts: every module made by transformers' `use_experts_implementation`
  gets the ragged-dot kernel's `experts_forward`, registered in
  `ALL_EXPERTS_FUNCTIONS` and selected with `model.set_experts_implementation`
  (which also reaches the sub-models of multimodal models).
* rmsnorm: every module whose own forward computes `weight * normalise(x)`
  or `(1 + weight) * normalise(x)` gets the forward of the rmsnorm kernel's
  matching layer: through `kernels.kernelize` for the layers transformers
  labels ("RMSNorm", "RMSNormZeroCentered"), bound directly for the norms it
  does not decorate (Gemma's, ...). The kernel decides the match
  (`layers.matching_layer_name`) by running the module's forward on a small
  probe, so gated or other norms keep theirs.
* attention: by transformers' flash path (a Hub kernel, in inference: `generate` and `generate_batch`), by
  the kernel's `attention_forward` registered in transformers' attention and mask interfaces, or for latent
  attention (MLA) models over transformers' latent cache (`tpu_kernels.integration.attention` says which route
  when, and why).

kernelize changes only the model it is given. transformers reads the experts
and attention implementations from the model's config, and models built from
one config object share it (`from_config(cfg)` keeps `cfg`): before selecting
an implementation, kernelize gives the model its own copy of its config (and
sub-configs), so other models of that config, and models built from it later,
keep theirs.

Kernels load through `tpu_kernels.get_kernel` (Hub) or `get_local_kernel` (a build
folder), so every variant is checked against its digest before it runs. Fallback
(`use_fallback=True`, the default) keeps a kind's original forward only when its
kernel cannot serve it, for one of these reasons, which the report names:

* the kernel has no build variant for this system;
* the mode asks for what the kernel does not declare (backward for TRAINING,
  `can_torch_compile` for TORCH_COMPILE);
* the layers need what the kernel does not compute (attention dropout in
  TRAINING, a head_dim it lacks, a norm it does not compute exactly).

Anything else raises whatever `use_fallback` says: a tampered or unverifiable
kernel (KernelIntegrityError), an untrusted publisher, a missing version or
repo, a bad spec, a Hub out of reach (HubUnreachableError, naming the Hub and
the network failure), an error inside the kernel's code; the error carries a
note naming the kind and the kernel it was loading. The returned model carries a report (`model.tpu_kernels_report`) of what was
replaced, by which repo and version, and what was not and why.

Importing this module imports neither `kernels` nor transformers: they load on
the first call (`import tpu_kernels` stays light).
"""

from __future__ import annotations

import copy
import logging
import types
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from ..compile_cache import keep_compiled_programs
from .attention import kernelize_attention
from .fixed_shapes import install as install_fixed_shapes
from .fixed_shapes import wanted as wants_fixed_shapes
from .report import KernelizeReport, QuantizationReport, ReportEntry, mode_refusal

if TYPE_CHECKING:
    import torch
    from kernels import Mode

logger = logging.getLogger(__name__)

DEFAULT_ORG = "tpu-kernels"
DEFAULT_REPOS = {
    "experts": f"{DEFAULT_ORG}/ragged-dot-tpu@1",
    "rmsnorm": f"{DEFAULT_ORG}/rmsnorm-tpu@1",
    "attention": f"{DEFAULT_ORG}/attention-tpu@1",
}
KINDS = ("experts", "rmsnorm", "attention")


@dataclass(frozen=True)
class KernelSpec:
    """`org/name@version` on a Hub, or a local built repo folder."""

    repo: str
    version: int | None
    local_path: Path | None

    @classmethod
    def parse(cls, spec: str) -> KernelSpec:
        path = Path(spec)
        if path.is_dir():
            return cls(repo=str(path), version=None, local_path=path)
        repo, _, version = spec.partition("@")
        if repo.count("/") != 1 or not version.isdigit():
            raise ValueError(f"kernel spec {spec!r} must be 'org/name@<version>' or a local build folder")
        return cls(repo=repo, version=int(version), local_path=None)

    def load(self, backend: str, trust_remote_code: bool | list[str]) -> ModuleType:
        from ..distribution.loader import get_kernel, get_local_kernel

        if self.local_path is not None:
            return get_local_kernel(self.local_path, backend=backend)
        return get_kernel(self.repo, version=self.version, backend=backend, trust_remote_code=trust_remote_code)

    def __str__(self) -> str:
        return self.repo if self.version is None else f"{self.repo}@{self.version}"


def _model_device(model) -> str:
    parameter = next(model.parameters(), None)
    return parameter.device.type if parameter is not None else "cpu"


def give_own_config(model) -> bool:
    """Point every module of `model` at a deep copy of the model's config (sub-configs included).

    Modules keep the config they were built with (`self.config`), so each
    reference to the old config, or to one of its sub-configs, is replaced by
    its copy; nothing outside the model is touched. False (nothing done) for
    a model without a transformers config.
    """
    from transformers import PretrainedConfig

    if not isinstance(getattr(model, "config", None), PretrainedConfig):
        return False
    copies: dict[int, object] = {}
    copy.deepcopy(model.config, copies)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, PretrainedConfig) and id(value) in copies:
                setattr(module, name, copies[id(value)])
    return True


def experts_modules(model) -> list[str]:
    """Names of the modules transformers' `use_experts_implementation` decorated."""
    return [
        name
        for name, module in model.named_modules()
        if all(hasattr(module, attr) for attr in ("has_gate", "is_transposed", "is_concatenated", "_apply_gate"))
    ]


def _kernelize_experts(model, spec: KernelSpec, kernel: ModuleType, mode: Mode, device: str) -> ReportEntry:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    modules = tuple(experts_modules(model))
    if not modules:
        return ReportEntry("experts", False, (), str(spec), "the model has no experts modules")
    unsupported = mode_refusal(kernel.experts_forward, mode)
    if unsupported:
        return ReportEntry("experts", False, modules, str(spec), unsupported)
    # One name per loaded build: two versions can be registered side by side.
    name = f"tpu_kernels_{kernel.__name__.lstrip('_')}"
    ALL_EXPERTS_FUNCTIONS.register(name, kernel.experts_forward)
    model.set_experts_implementation(name)
    return ReportEntry("experts", True, modules, str(spec))


@dataclass(frozen=True)
class LoadedLayerRepository:
    """A kernels layer repository (its `RepositoryProtocol`) serving a layer of an already loaded kernel.

    kernels' own repositories load the kernel again, from the Hub or a path; this one
    hands kernels' kernelize the module that was loaded and verified.
    """

    kernel: ModuleType
    layer_name: str

    def load(self) -> type:
        return getattr(self.kernel.layers, self.layer_name)

    def __str__(self) -> str:
        return f"`{self.kernel.__name__}` (layer `{self.layer_name}`)"


def _kernelize_rmsnorm(model, spec: KernelSpec, kernel: ModuleType, mode: Mode, device: str) -> ReportEntry:
    from kernels import kernelize as kernels_kernelize
    from kernels import use_kernel_mapping

    from .parallel import applied_plan, replacement_conflict

    # Which kernel layer computes each module's forward exactly; the kernel
    # decides by running the module's own forward on a small probe. Norms whose
    # forward a parallel plan wrapped keep it where replacing would lose what it does.
    plan = applied_plan(model)
    matches = {}
    for name, module in model.named_modules():
        layer_name = kernel.layers.matching_layer_name(module)
        if layer_name is not None and replacement_conflict(plan, name, module, mode) is None:
            matches[name] = (module, layer_name)
    if not matches:
        return ReportEntry("rmsnorm", False, (), str(spec), "no RMSNorm modules the kernel computes exactly")
    unsupported = {why for _, layer in matches.values() if (why := mode_refusal(getattr(kernel.layers, layer), mode))}
    if unsupported:
        return ReportEntry("rmsnorm", False, tuple(matches), str(spec), "; ".join(sorted(unsupported)))

    # Layers transformers labels ("RMSNorm", "RMSNormZeroCentered") go through
    # kernels' own kernelize, served from the module we loaded (and verified).
    labelled = {n for n, (m, layer) in matches.items() if getattr(type(m), "kernel_layer_name", None) == layer}
    mapping = {
        layer: {device: LoadedLayerRepository(kernel, layer)} for layer in {matches[n][1] for n in labelled}
    }
    # kernels' kernelize is given only these norms: on a whole model it would also visit every other
    # labelled layer (rotary_pos_emb, SiLU, ...), warn that it has no mapping for it and set its forward
    # back to the class's, dropping wrappers a parallel plan installed.
    with use_kernel_mapping(mapping, inherit_mapping=False):
        for name in labelled:
            kernels_kernelize(matches[name][0], mode=mode, device=device)
    # The rest (Gemma's and other undecorated norms) get the matching layer's forward bound directly.
    for name, (module, layer) in matches.items():
        if name not in labelled:
            module.forward = types.MethodType(getattr(kernel.layers, layer).forward, module)
    return ReportEntry("rmsnorm", True, tuple(matches), str(spec))


APPLIERS = {"experts": _kernelize_experts, "rmsnorm": _kernelize_rmsnorm, "attention": kernelize_attention}


def _quantize_experts(model, entry: ReportEntry | None, kernel: ModuleType | None, scheme: str) -> QuantizationReport:
    """Quantize the experts modules the kernel now serves with its fused path (`tpu_kernels.integration.quantize`)."""
    from .quantize import quantize_experts_module, why_not_quantized

    report = QuantizationReport(scheme)
    if entry is None or not entry.replaced:
        names = entry.modules if entry is not None else ()
        report.kept.update({name: "the experts were not replaced by the kernel" for name in names})
        return report
    modules = dict(model.named_modules())
    for name in entry.modules:
        module = modules[name]
        if kernel.fused_gate(module) is None:
            report.kept[name] = "a gate the fused experts op does not compute (its composed path takes float weights)"
        elif not module.gate_up_proj.dtype.is_floating_point or module.gate_up_proj.element_size() == 1:
            report.kept[name] = f"weights already {module.gate_up_proj.dtype}"
        elif (why := why_not_quantized(module, scheme, kernel)) is not None:
            report.kept[name] = why
        else:
            report.quantized.append(quantize_experts_module(name, module, scheme, kernel))
    return report


def _check_arguments(mode: Mode, repos: dict[str, str | None] | None, quantize_experts: str | None) -> None:
    """Raises ValueError for an unknown quantization scheme, quantized experts in TRAINING, or an unknown kind."""
    from kernels import Mode

    from .quantize import check_scheme

    check_scheme(quantize_experts)
    if quantize_experts is not None and Mode.TRAINING in mode:
        raise ValueError(
            f"kernelize: quantize_experts={quantize_experts!r} with Mode.TRAINING: one-byte expert weights serve "
            "inference only (no gradient through them); train with float weights"
        )
    unknown = set(repos or ()) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kernel kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}")


def kernelize(
    model,
    *,
    mode: Mode | None = None,
    device: str | None = None,
    repos: dict[str, str | None] | None = None,
    trust_remote_code: bool | list[str] = False,
    use_fallback: bool = True,
    quantize_experts: str | None = None,
    fixed_shapes: bool | None = None,
) -> "torch.nn.Module":
    """Replace the model's layers with TPU kernels from the Hub; returns the model.

    Args:
        mode: `kernels.Mode`; None is Mode.INFERENCE. A kernel serves TRAINING or
            TORCH_COMPILE only where it declares support for them.
        device: "tpu" or "cpu"; the model's device when None. On TPU the
            torch-tpu variant is loaded, elsewhere torch-cpu (interpret mode:
            exact but slow).
        repos: per kind ("experts", "rmsnorm", "attention"), `org/name@version`
            or a local build folder, overriding the defaults of our own org;
            None leaves that kind alone.
        use_fallback: keep the original forward of a kind whose kernel cannot serve it
            (no build for this system, an unsupported mode or layer; the report says
            which) instead of raising. Integrity, trust, loading and other errors
            always raise.
        quantize_experts: None, "int8" (symmetric, per output channel), "fp8" (e4m3 in 128 x 128
            blocks, transformers' fine-grained FP8) or "int4" (symmetric, per output channel, two
            per byte; not on TPU7x, where fp8 is the format): the float weights of every experts
            module the kernel serves are quantized once, in place, and read as one byte (int4: half
            a byte) per weight from then on (`tpu_kernels.integration.quantize`); the report gives
            the bytes before and after.
        fixed_shapes: the fixed-shape recipe for `generate` (`tpu_kernels.integration.fixed_shapes`: prompts
            padded to token buckets, a static cache at a key bucket); None turns it on for a model on a TPU.
    """
    from kernels import Mode

    from ..distribution.loader import VariantNotFoundError

    mode = Mode.INFERENCE if mode is None else mode
    _check_arguments(mode, repos, quantize_experts)
    specs = {**DEFAULT_REPOS, **(repos or {})}
    device = device or _model_device(model)
    backend = "tpu" if device == "tpu" else "cpu"
    report = KernelizeReport(mode=mode.name.replace("|", " | "), compile_caches=keep_compiled_programs())
    if specs["experts"] is not None or specs["attention"] is not None:
        report.own_config = give_own_config(model)
    loaded = {}
    for kind in KINDS:
        if specs[kind] is None:
            report.entries.append(ReportEntry(kind, False, (), "-", "disabled (repos[kind] is None)"))
            continue
        spec = KernelSpec.parse(specs[kind])
        try:
            kernel = spec.load(backend, trust_remote_code)
        except VariantNotFoundError as error:
            if not use_fallback:
                raise
            entry = ReportEntry(kind, False, (), str(spec), f"the kernel has no build for this system: {error}")
        except Exception as error:
            error.add_note(f"kernelize: while loading the {kind} kernel {spec}")
            raise
        else:
            if kind == "experts" and quantize_experts is not None:
                # Before the model changes: a format this chip is not served in is refused whole.
                kernel.check_scheme_served(quantize_experts)
            loaded[kind] = kernel
            entry = APPLIERS[kind](model, spec, kernel, mode, backend)
        if not entry.replaced and entry.modules and not use_fallback:
            raise RuntimeError(f"kernelize: {kind} not replaced: {entry.reason}")
        report.entries.append(entry)
    if quantize_experts is not None:
        experts_entry = next((e for e in report.entries if e.kind == "experts"), None)
        report.quantization = _quantize_experts(model, experts_entry, loaded.get("experts"), quantize_experts)
    if wants_fixed_shapes(fixed_shapes, device):
        report.fixed_shapes = install_fixed_shapes(model, loaded.get("attention"))
    model.tpu_kernels_report = report
    logger.info("%r", report)
    return model
