"""What `kernelize` tells its caller: per kind of layer, what was replaced, by which kernel, and what was not and
why (`model.tpu_kernels_report`); and the one rule for whether a kernel's function serves a `kernels.Mode`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..compile_cache import CompileCaches

if TYPE_CHECKING:
    from kernels import Mode


@dataclass(frozen=True)
class ReportEntry:
    kind: str
    replaced: bool
    modules: tuple[str, ...]
    source: str
    reason: str = ""
    note: str = ""  # how a replaced kind is served, when that matters to the user


@dataclass
class QuantizationReport:
    """What `quantize_experts` did: the modules quantized with their bytes, and those kept float and why."""

    scheme: str
    quantized: list = field(default_factory=list)  # quantize.QuantizedModule
    kept: dict[str, str] = field(default_factory=dict)  # module name -> reason

    @property
    def bytes_before(self) -> int:
        return sum(m.bytes_before for m in self.quantized)

    @property
    def bytes_after(self) -> int:
        return sum(m.bytes_after for m in self.quantized)

    def __repr__(self) -> str:
        lines = []
        if self.quantized:
            before, after = self.bytes_before, self.bytes_after
            lines.append(f"  quantized {len(self.quantized)} experts module(s) to {self.scheme}: weights "
                         f"{before / 1e6:.3f} MB -> {after / 1e6:.3f} MB with scales ({after / before:.1%})")
        for reason in sorted(set(self.kept.values())):
            names = [name for name, why in self.kept.items() if why == reason]
            lines.append(f"  not quantized ({len(names)} module(s)): {reason}")
        return "\n".join(lines)


@dataclass
class KernelizeReport:
    mode: str = "INFERENCE"
    entries: list[ReportEntry] = field(default_factory=list)
    quantization: QuantizationReport | None = None
    own_config: bool = False  # the model was given its own copy of its config
    compile_caches: CompileCaches | None = None  # where compiled kernels are kept for the next process
    fixed_shapes: str | None = None  # what the fixed-shape recipe does, when it is on (fixed_shapes.py)

    def replaced(self, kind: str) -> list[ReportEntry]:
        return [e for e in self.entries if e.kind == kind and e.replaced]

    def __repr__(self) -> str:
        lines = [f"kernelize report ({self.mode}):"]
        for e in self.entries:
            status = "replaced" if e.replaced else "kept original"
            where = f"{len(e.modules)} module(s)" if e.modules else "no modules"
            detail = f" by {e.source}" if e.replaced else f": {e.reason}"
            lines.append(f"  {e.kind:<9} {status}{detail} ({where})")
            if e.note:
                lines.append(f"            {e.note}")
        if self.own_config:
            lines.append("  config    the model's own copy: the experts and attention implementations are set on it, "
                         "not on the config object the model was built from")
        if self.quantization is not None:
            lines.append(repr(self.quantization))
        if self.fixed_shapes is not None:
            lines.append(f"  shapes    fixed: {self.fixed_shapes}")
        if self.compile_caches is not None:
            kept = ", ".join(f"{name} in {folder}" for name, folder in (
                ("torch_tpu", self.compile_caches.torch_tpu), ("jax", self.compile_caches.jax)) if folder)
            lines.append(f"  compiles kept for the next process: {kept or 'nowhere (caches off)'}")
            removed = self.compile_caches.removed
            if removed:
                lines.append(f"  compile cache entries removed as unsafe (a link, another user's, or writable by "
                             f"others): {len(removed)}, e.g. {removed[0]}")
        return "\n".join(lines)


def mode_refusal(kernel_fn, mode: Mode) -> str | None:
    """Why `kernel_fn` cannot serve `mode`, or None if it can."""
    from kernels import Mode

    if Mode.TRAINING in mode and not getattr(kernel_fn, "has_backward", False):
        return "the kernel has no backward (TRAINING)"
    if Mode.TORCH_COMPILE in mode and not getattr(kernel_fn, "can_torch_compile", False):
        return "the kernel does not declare torch.compile support"
    return None
