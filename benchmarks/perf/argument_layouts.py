"""The layout XLA gives each argument of a compiled program, and the copies it makes of an argument per call.

XLA picks a jitted function's argument layouts itself (`runtime.hardware.default_layout_swaps_minor_dims`
states the rule we know). A Pallas kernel reads its operands row-major, so where XLA stores an argument in
another order and hands it to a kernel, every call first copies the whole argument into a row-major
temporary: for a paged KV cache, the whole cache, K and V, at every attention layer of every step.

`probe(fn, avals, generation)` compiles `fn` for a generation's compile-only topology (kernel bodies left empty:
the program around the kernels, their operands' layouts and the copies are what a real compile gives, in a
second) and reads, from the optimized module, each entry parameter's layout and the copies and transposes
of it (looking through bitcasts, e.g. `k[None]`) with their HBM bytes (read + written).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence

import jax

from tpu_kernels.aot import topology_device
from tpu_kernels.runtime.hardware import tpu_generation
from . import hlo, xla_program
from .chip import FITTED_RATES, ModelRates
from .program_time import VMEM_BANDWIDTH_OVER_HBM

# Opcodes that rewrite their operand into a new buffer (a prefetch into VMEM, `copy-start`, or a slice is not
# one: it keeps the layout).
_REWRITES = frozenset({"copy", "transpose"})
# What passes an argument on unchanged in layout: re-descriptions and prefetches (the argument sliced into VMEM,
# its slices joined again).
_PASSES_ON = frozenset({"bitcast", "async-start", "async-done", "copy-start", "copy-done", "get-tuple-element"})
_JOINS = frozenset({"ConcatBitcast"})


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copy of an argument (or of a result) into another layout."""

    name: str
    opcode: str
    minor_to_major: tuple[int, ...]  # the copy's layout
    space: str  # where XLA put the copy: hlo.HBM or hlo.VMEM
    bytes: int  # the array rewritten
    hbm_bytes: int  # HBM bytes the copy reads and writes
    vmem_bytes: int = 0  # VMEM bytes it reads and writes

    def describe(self) -> str:
        order = ",".join(map(str, self.minor_to_major))
        return f"{self.name}: {self.opcode} into {{{order}}} in {self.space}, {self.bytes / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class ArgumentLayout:
    """One entry parameter of a compiled program and the copies XLA makes of it on every call."""

    number: int
    name: str
    dtype: str
    dims: tuple[int, ...]
    minor_to_major: tuple[int, ...]  # XLA's layout, e.g. (1, 3, 2, 0): dimension 1 is the minor one
    copies: tuple[Copy, ...]

    @property
    def row_major(self) -> bool:
        return self.minor_to_major == tuple(reversed(range(len(self.dims))))

    @property
    def copied_bytes(self) -> int:
        """Bytes XLA rewrites into another layout per call (in HBM or VMEM)."""
        return sum(copy.bytes for copy in self.copies)

    @property
    def hbm_bytes(self) -> int:
        """HBM bytes those copies read and write per call."""
        return sum(copy.hbm_bytes for copy in self.copies)


@dataclasses.dataclass(frozen=True)
class LayoutProbe:
    generation: str
    arguments: tuple[ArgumentLayout, ...]
    result_copies: tuple[Copy, ...]  # the kernels' results copied into the program result's layout

    @property
    def copied_bytes(self) -> int:
        """Bytes XLA rewrites per call, arguments into the kernels' layouts and results back."""
        return sum(argument.copied_bytes for argument in self.arguments) + sum(c.bytes for c in self.result_copies)

    @property
    def hbm_bytes(self) -> int:
        """HBM bytes those copies read and write per call."""
        return sum(argument.hbm_bytes for argument in self.arguments) + sum(c.hbm_bytes for c in self.result_copies)

    @property
    def copies(self) -> tuple[Copy, ...]:
        return tuple(copy for argument in self.arguments for copy in argument.copies) + self.result_copies

    def argument(self, number: int) -> ArgumentLayout:
        return next(argument for argument in self.arguments if argument.number == number)

    def seconds(self, hbm_fraction: float | None = None, rates: ModelRates = FITTED_RATES) -> float:
        """The copies priced as `program_time` prices an XLA op: the slower of its HBM bytes at `hbm_fraction`
        of the device's peak bandwidth (None: the generation's fitted share) and its VMEM bytes at VMEM's."""
        gen = tpu_generation(self.generation)
        fraction = rates.hbm_fraction(gen) if hbm_fraction is None else hbm_fraction
        hbm_bandwidth = gen.device_hbm_bytes_per_s * fraction
        vmem_bandwidth = gen.device_hbm_bytes_per_s * VMEM_BANDWIDTH_OVER_HBM
        return sum(max(copy.hbm_bytes / hbm_bandwidth, copy.vmem_bytes / vmem_bandwidth) for copy in self.copies)


def argument_layouts(text: str) -> tuple[tuple[ArgumentLayout, ...], tuple[Copy, ...]]:
    """Each entry parameter of an optimized HLO module's text, in parameter order, with its copies; and the
    copies that make the module's result."""
    computations, entry = hlo.parse_module(text)
    instructions = computations[entry]
    by_name = {inst.name: inst for inst in instructions}
    found = []
    for inst in instructions:
        if inst.opcode != "parameter" or not isinstance(inst.shape, hlo.Leaf):
            continue
        copies = [_copy(other, by_name) for other in instructions
                  if other.opcode in _REWRITES and other.operands and _source(other.operands[0], by_name) == inst.name]
        found.append(ArgumentLayout(number=int(inst.arguments.strip()), name=inst.name, dtype=inst.shape.dtype,
                                    dims=inst.shape.dims, minor_to_major=_minor_to_major(inst.shape.layout),
                                    copies=tuple(copies)))
    root = instructions[-1]
    made = [by_name[name] for name in root.operands if name in by_name] if root.opcode == "tuple" else [root]
    result_copies = tuple(_copy(inst, by_name) for inst in made
                          if inst.opcode in _REWRITES and by_name.get(_source(inst.operands[0], by_name)) is not None
                          and by_name[_source(inst.operands[0], by_name)].opcode != "parameter")
    return tuple(sorted(found, key=lambda argument: argument.number)), result_copies


def probe(fn, avals: Sequence[jax.ShapeDtypeStruct], generation: str,
          major_to_minor: Sequence[tuple[int, ...] | None] | None = None) -> LayoutProbe:
    """`fn` compiled at `avals` for `generation` (empty kernel bodies) and its arguments' layouts and copies.

    `major_to_minor` pins argument i's layout where its entry is not None (as a caller that keeps the array in
    that layout would, `jax.jit(in_shardings=Format(Layout(...)))`); None: XLA picks every layout.
    """
    if major_to_minor is None:
        lowered = xla_program.lower_program(fn, avals, generation, kernel_bodies=False)
    else:
        lowered = _lower_pinned(fn, avals, generation, major_to_minor)
    with tempfile.TemporaryDirectory(prefix="xla_dump_") as dump:
        lowered.compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True})
        text = xla_program.dumped_module(dump, "after_optimizations.txt").read_text()
    return LayoutProbe(generation, *argument_layouts(text))


def _lower_pinned(fn, avals, generation: str, major_to_minor):
    from jax.experimental.layout import Format, Layout

    device = topology_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
    formats = [sharding if order is None else Format(Layout(major_to_minor=tuple(order)), sharding)
               for order in major_to_minor]
    with jax.default_device(device), xla_program._empty_kernel_bodies():
        return jax.jit(fn, in_shardings=tuple(formats)).lower(*placed)


def _source(name: str, by_name) -> str:
    """The buffer `name` holds in another guise: through re-descriptions, prefetches and joined slices."""
    while name in by_name and by_name[name].operands:
        inst = by_name[name]
        if inst.opcode in _PASSES_ON or (inst.opcode == "custom-call" and hlo.target(inst) in _JOINS):
            name = inst.operands[0]
        else:
            break
    return name


def _copy(inst: hlo.Instruction, by_name) -> Copy:
    result = hlo.leaves(inst.shape)[0]
    touched = [*hlo.leaves(by_name[inst.operands[0]].shape), result]
    hbm, vmem = (sum(leaf.bytes for leaf in touched if leaf.space == space) for space in (hlo.HBM, hlo.VMEM))
    return Copy(inst.name, inst.opcode, _minor_to_major(result.layout), result.space, result.bytes, hbm, vmem)


def _minor_to_major(layout: str) -> tuple[int, ...]:
    order = layout.split(":")[0]
    return tuple(int(d) for d in order.split(",") if d.strip())
