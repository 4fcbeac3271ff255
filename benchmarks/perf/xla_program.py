"""What XLA does around Pallas kernels in a program compiled for a TPU: each op's HBM traffic and placement.

`lower_program(fn, avals, generation)` lowers `fn` for a TPU generation's
compile-only device (libtpu compile-only topology, as `aot.compile_for`);
`calibration.compile_text` compiles it with XLA's HLO dump switched on for
that one compile, and `analyse_hlo` reads the optimized module
(`*.after_optimizations.txt`, read by `hlo`). Every instruction of the entry
computation becomes a `ProgramOp` with

- the memory space XLA assigned to each operand and result: the layout's
  `S(n)` annotation, none or S(0) = HBM, S(1) = VMEM, any other (SMEM, sync
  flags) small on-chip buffers;
- the HBM bytes it reads and writes and the VMEM bytes it touches. A fused
  operand read only through gather / slice / dynamic-slice counts the bytes
  those ops produce, not the whole operand (a gather's repeated rows again:
  more than the operand when indices repeat). Prefetches (`copy-start`, sliced
  `async-start`) count their copy; `*-done`, bitcasts, tuples and parameters
  move nothing. Bytes are logical: HBM tile padding is ignored;
- the cycles XLA's own TPU cost model estimated for it, where the backend
  annotated them (`estimated_cycles` in `*.after_codegen.txt`; many ops,
  e.g. sorts and scatters, carry none).

Pallas kernels (custom-call target `tpu_custom_call`) are listed apart as
`KernelCall`s with the placement of their operands and results; their
traffic is `benchmarks.perf`'s grid replay. An XLA ragged dot's loop is
read from its fusion's backend config (`ProgramOp.ragged_dot`). A while
loop's body counts once per known trip (once, with a note, when XLA states
no trip count). `benchmarks.perf.program_time.model_program` prices the
program read here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from collections.abc import Sequence
from pathlib import Path

import jax

from . import hlo, xla_ragged_dot
from tpu_kernels.aot import topology_device

PALLAS_TARGET = "tpu_custom_call"
# A copy of an entry parameter into another layout: XLA's default TPU layout of an argument differs from
# the one a consumer (e.g. a Pallas kernel's operand layout constraint) needs, so every call rewrites it.
RELAYOUT = "relayout of"

# Opcodes that move no data themselves (or whose copy is charged at the matching start).
_FREE_OPCODES = frozenset({
    "parameter", "constant", "bitcast", "get-tuple-element", "tuple", "copy-done", "async-done", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain",
})
# Custom calls that only re-describe buffers.
_FREE_TARGETS = frozenset({"AllocateBuffer", "ConcatBitcast", "AssumeGatherIndicesInBound"})
# Ops that read only the part of their first operand they produce.
_SLICING_OPCODES = frozenset({"gather", "slice", "dynamic-slice"})


@dataclasses.dataclass(frozen=True)
class ProgramOp:
    """One XLA instruction of the entry computation and what it moves."""

    name: str
    opcode: str
    detail: str  # fused computation kind, custom-call target, or the sliced operand of a prefetch
    hbm_read_bytes: int
    hbm_write_bytes: int
    vmem_bytes: int
    estimated_cycles: int | None
    prefetch: bool
    # XLA's loop for a `lax.ragged_dot_general` (`xla_ragged_dot`): priced by replaying it, not by its traffic.
    ragged_dot: xla_ragged_dot.Windows | None = None
    # A copy whose result's minor dimension is not its operand's (`CompiledProgram.transpose_ops`).
    transposes: bool = False

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """A Pallas kernel in the compiled program: where XLA placed its operands and results."""

    name: str
    operand_spaces: tuple[str, ...]
    operand_bytes: tuple[int, ...]
    result_spaces: tuple[str, ...]
    result_bytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    generation: str
    ops: tuple[ProgramOp, ...]
    kernels: tuple[KernelCall, ...]
    cost_analysis: dict
    memory: dict
    notes: tuple[str, ...]

    @property
    def hbm_bytes(self) -> int:
        return sum(op.hbm_bytes for op in self.ops)

    @property
    def vmem_bytes(self) -> int:
        return sum(op.vmem_bytes for op in self.ops)

    @property
    def relayout_bytes(self) -> int:
        """HBM bytes of copies that only change an argument's layout (module docstring of RELAYOUT)."""
        return sum(op.hbm_bytes for op in self.ops if op.detail.startswith(RELAYOUT))

    @property
    def prefetch_bytes(self) -> int:
        """HBM bytes of XLA's prefetches into VMEM (`copy-start`, sliced `async-start`): charged serially by
        `program_time.model_program`, though on a chip such a copy may overlap the kernels XLA schedules before
        its done."""
        return sum(op.hbm_bytes for op in self.ops if op.prefetch)

    @property
    def transpose_ops(self) -> tuple[ProgramOp, ...]:
        """The copies that transpose: their result's minor dimension differs from their operand's.

        TPU's default layout of an argument puts a dimension that is a multiple of 128 minor when the
        logical minor one is not (bf16[327680,2880] is stored {0,1}, bf16[128,2880,2880] {0,2,1},
        bf16[B,S,H,64] {1,3,2,0}); a kernel that needs the logical layout then makes every call transpose
        the argument (and its result back). XLA emits such a copy as an XLU transpose loop (bf16 unpacked
        to 32 bits, `vxpose`, repacked) fed by pipelined DMAs; they are priced like any copy, at their
        HBM bytes (calibration reports their share apart, `terms_us["xla_transposes"]`).
        """
        return tuple(op for op in self.ops if op.transposes)

    @property
    def moving_ops(self) -> tuple[ProgramOp, ...]:
        """The XLA ops that read or write any buffer (launches, as opposed to free re-descriptions)."""
        return tuple(op for op in self.ops if op.hbm_bytes or op.vmem_bytes)

    def placements(self, min_bytes: int = 1 << 20) -> list[str]:
        """Human-readable list of the large buffers XLA keeps in VMEM or prefetches there."""
        lines = []
        for op in self.ops:
            if op.detail.startswith(RELAYOUT) and op.hbm_bytes >= min_bytes:
                lines.append(f"{op.name}: {op.detail}, {op.hbm_bytes / 2**20:.1f} MiB of HBM traffic per call")
            elif op.prefetch and op.hbm_read_bytes >= min_bytes:
                lines.append(f"{op.name}: prefetches {op.hbm_read_bytes / 2**20:.1f} MiB of {op.detail} into VMEM")
            elif not op.prefetch and op.vmem_bytes >= min_bytes and not op.hbm_bytes:
                lines.append(f"{op.name} ({op.opcode} {op.detail}): runs on {op.vmem_bytes / 2**20:.1f} MiB in VMEM")
        for kernel in self.kernels:
            for number, (space, size) in enumerate(zip(kernel.operand_spaces, kernel.operand_bytes)):
                if space == hlo.VMEM and size >= min_bytes:
                    lines.append(f"{kernel.name}: operand {number} ({size / 2**20:.1f} MiB) read from VMEM")
            for number, (space, size) in enumerate(zip(kernel.result_spaces, kernel.result_bytes)):
                if space == hlo.VMEM and size >= min_bytes:
                    lines.append(f"{kernel.name}: result {number} ({size / 2**20:.1f} MiB) kept in VMEM")
        return lines


def lower_program(fn, avals: Sequence[jax.ShapeDtypeStruct], generation: str, *, kernel_bodies: bool = True):
    """`fn` traced and lowered for `generation`'s compile-only device (cheap; `calibration.compile_text` compiles it).

    `kernel_bodies=False` lowers every `pl.pallas_call` with an empty body (same grid, specs and operands):
    the XLA program around the kernels, their operands' placement and layouts are unchanged, and Mosaic
    compiles in a second instead of up to a minute for a large kernel. For analysing the program only: the
    kernels' own time comes from `perf`'s replay of the real bodies.
    """
    device = topology_device(generation)
    sharding = jax.sharding.SingleDeviceSharding(device)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
    bodies = contextlib.nullcontext() if kernel_bodies else _empty_kernel_bodies()
    # Kernels that ask jax which TPU they are traced for (`pltpu.get_tpu_info()`, e.g. emit_pipeline's DMA
    # tiling) read the default device.
    with jax.default_device(device), bodies:
        return jax.jit(fn).lower(*placed)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _empty_kernel_bodies():
    """`jax.experimental.pallas.pallas_call` (as kernels call it, `pl.pallas_call`) with an empty kernel body."""
    from jax.experimental import pallas

    def empty_body(*refs):
        del refs

    def pallas_call_with_empty_body(kernel, *args, **kwargs):
        del kernel
        return original(empty_body, *args, **kwargs)

    with _PATCH_LOCK:
        original = pallas.pallas_call
        pallas.pallas_call = pallas_call_with_empty_body
        try:
            yield
        finally:
            pallas.pallas_call = original


def dumped_module(folder: str, suffix: str, required: bool = True) -> Path | None:
    found = sorted(Path(folder).glob(f"*.{suffix}"))
    if len(found) > 1:
        raise RuntimeError(f"XLA dumped {len(found)} modules ending in {suffix} for one compile: {found}")
    if not found and required:
        raise RuntimeError(f"XLA dumped no *.{suffix} (the HLO dump options were ignored?)")
    return found[0] if found else None


def memory_stats(compiled) -> dict:
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {field: int(getattr(stats, field)) for field in fields} if stats is not None else {}


def analyse_hlo(
    text: str,
    generation: str,
    *,
    codegen_text: str | None = None,
    cost_analysis: dict | None = None,
    memory: dict | None = None,
) -> CompiledProgram:
    """A `CompiledProgram` from the text of an optimized HLO module (and optionally its after-codegen text)."""
    computations, entry = hlo.parse_module(text)
    cycles = hlo.estimated_cycles(codegen_text) if codegen_text else {}
    ops, kernels, notes = [], [], []
    _walk(computations, entry, 1, cycles, ops, kernels, notes)
    return CompiledProgram(
        generation=generation,
        ops=tuple(ops),
        kernels=tuple(kernels),
        cost_analysis={k: float(v) for k, v in (cost_analysis or {}).items() if not k.startswith("utilization")},
        memory=dict(memory or {}),
        notes=tuple(notes),
    )


def _walk(computations, name, repeats, cycles, ops, kernels, notes):
    instructions = computations[name]
    by_name = {inst.name: inst for inst in instructions}
    for inst in instructions:
        if inst.opcode == "custom-call" and hlo.target(inst) == PALLAS_TARGET:
            operands = [by_name[o].shape for o in inst.operands if o in by_name]
            results = hlo.leaves(inst.shape)
            kernels.append(KernelCall(
                name=inst.name,
                operand_spaces=tuple(hlo.single_space(s) for s in operands),
                operand_bytes=tuple(sum(leaf.bytes for leaf in hlo.leaves(s)) for s in operands),
                result_spaces=tuple(leaf.space for leaf in results),
                result_bytes=tuple(leaf.bytes for leaf in results),
            ))
            continue
        if inst.opcode == "while":
            body = hlo.attribute(inst.attributes, "body")
            trips = re.search(r'known_trip_count[^0-9]*"?n"?\D*(\d+)', inst.attributes)
            if not trips:
                notes.append(f"{inst.name}: while loop without a known trip count, its body counted once")
            if body in computations:
                _walk(computations, body, repeats * (int(trips.group(1)) if trips else 1), cycles, ops, kernels, notes)
            continue
        if inst.opcode in ("conditional", "call"):
            notes.append(f"{inst.name}: {inst.opcode} not modelled (its called computations move no counted bytes)")
            continue
        op = _op_traffic(inst, by_name, computations)
        if op is None:
            continue
        if repeats != 1:
            op = dataclasses.replace(op, hbm_read_bytes=op.hbm_read_bytes * repeats,
                                     hbm_write_bytes=op.hbm_write_bytes * repeats, vmem_bytes=op.vmem_bytes * repeats)
        estimate = cycles.get(inst.name)
        ops.append(dataclasses.replace(op, estimated_cycles=None if estimate is None else estimate * repeats))


@dataclasses.dataclass
class _Charges:
    """The bytes one instruction reads from and writes to HBM, and those it touches in VMEM."""

    hbm_read: int = 0
    hbm_write: int = 0
    vmem: int = 0

    def read(self, leaf: hlo.Leaf, size: int | None = None) -> None:
        size = leaf.bytes if size is None else size
        if leaf.space == hlo.HBM:
            self.hbm_read += size
        elif leaf.space == hlo.VMEM:
            self.vmem += size

    def write(self, leaf: hlo.Leaf) -> None:
        if leaf.space == hlo.HBM:
            self.hbm_write += leaf.bytes
        elif leaf.space == hlo.VMEM:
            self.vmem += leaf.bytes

    def read_all(self, shapes) -> None:
        for shape in shapes:
            for leaf in hlo.leaves(shape):
                self.read(leaf)

    def read_partially(self, shapes, partial: dict[int, int]) -> None:
        """Operand `number` read as `partial[number]` bytes (the rest whole): what the gathers and slices reading
        it produce, which is more than the operand where a gather takes a row more than once (nothing caches
        the rows an index repeats)."""
        for number, shape in enumerate(shapes):
            for leaf in hlo.leaves(shape):
                self.read(leaf, partial.get(number))

    def write_all(self, leaves) -> None:
        for leaf in leaves:
            self.write(leaf)

    @property
    def moves_bytes(self) -> bool:
        return bool(self.hbm_read or self.hbm_write or self.vmem)


def _op_traffic(inst: hlo.Instruction, by_name, computations) -> ProgramOp | None:
    if inst.opcode in _FREE_OPCODES:
        return None
    if inst.opcode == "custom-call" and hlo.target(inst) in _FREE_TARGETS:
        return None
    results = hlo.leaves(inst.shape)
    operand_shapes = [by_name[o].shape for o in inst.operands if o in by_name]
    detail = hlo.target(inst) or hlo.attribute(inst.attributes, "kind") or ""
    charges = _Charges()
    prefetch = False
    if inst.opcode == "copy-start":
        # (destination, source, context): the copy reads the source and fills the destination.
        destination = hlo.leaves(inst.shape[0])
        charges.read_all(operand_shapes)
        charges.write_all(destination)
        prefetch = any(leaf.space == hlo.VMEM for leaf in destination)
        detail = _source(inst.operands[0], by_name) if inst.operands else detail
    elif inst.opcode == "async-start":
        detail, prefetch = _charge_async_start(inst, operand_shapes, by_name, computations, charges, detail)
    elif inst.opcode == "async-update":
        _charge_async_update(inst, operand_shapes, charges)
    elif inst.opcode == "fusion":
        called = computations.get(hlo.attribute(inst.attributes, "calls"), [])
        charges.read_partially(operand_shapes, _partially_read_parameters(called))
        charges.write_all(results)
    elif inst.opcode in _SLICING_OPCODES:
        charges.read_partially(operand_shapes, {0: sum(leaf.bytes for leaf in results)})
        charges.write_all(results)
    else:
        charges.read_all(operand_shapes)
        charges.write_all(results)
    if not charges.moves_bytes:
        return None
    windows = _ragged_dot_windows(inst, computations) if inst.opcode == "fusion" else None
    return ProgramOp(inst.name, inst.opcode, _relayout(inst, by_name) or detail, charges.hbm_read,
                     charges.hbm_write, charges.vmem, None, prefetch, windows, _transposes(inst, by_name))


def _charge_async_start(
    inst: hlo.Instruction, operand_shapes, by_name, computations, charges: _Charges, detail: str
) -> tuple[str, bool]:
    """An async op's traffic, and its detail and whether it prefetches into VMEM.

    A sliced copy (a prefetch when it fills VMEM) reads only the slice it makes; any other async op reads
    its operands and writes result element 1.
    """
    called = computations.get(hlo.attribute(inst.attributes, "calls"), [])
    root = called[-1] if called else None
    if root is not None and root.opcode in ("slice", "dynamic-slice", "copy"):
        source = hlo.leaves(operand_shapes[0]) if operand_shapes else []
        destination = hlo.leaves(root.shape)
        for leaf in source:
            charges.read(leaf, sum(d.bytes for d in destination))
        charges.write_all(destination)
        detail = f"{_source(inst.operands[0], by_name)} ({root.opcode})" if inst.operands else root.opcode
        return detail, any(leaf.space == hlo.VMEM for leaf in destination)
    charges.read_all(operand_shapes)
    if isinstance(inst.shape, tuple) and len(inst.shape) > 1:
        charges.write_all(hlo.leaves(inst.shape[1]))
    return detail, False


def _charge_async_update(inst: hlo.Instruction, operand_shapes, charges: _Charges) -> None:
    """Offloaded gathers / scatters: the inputs arrive with the update; result element 1 is the output.

    A gather offloaded to the SparseCores (XLA names it `gather_offload...`) reads the rows it gathers,
    one per index (repeated rows again), not its whole table: its data operand is charged the output's
    bytes, its indices whole.
    """
    output = hlo.leaves(inst.shape[1]) if isinstance(inst.shape, tuple) and len(inst.shape) > 1 else []
    gather = inst.name.startswith("gather_offload")
    for number, shape in enumerate(operand_shapes[1:]):
        for leaf in hlo.leaves(shape):
            charges.read(leaf, sum(o.bytes for o in output) if gather and number == 0 else None)
    charges.write_all(output)


def _relayout(inst: hlo.Instruction, by_name) -> str | None:
    """The detail of a copy of an entry parameter into another layout (RELAYOUT), if `inst` is one."""
    if inst.opcode != "copy" or not inst.operands or by_name.get(inst.operands[0]) is None:
        return None
    source = by_name[inst.operands[0]]
    if source.opcode == "parameter" and isinstance(source.shape, hlo.Leaf) and isinstance(inst.shape, hlo.Leaf) \
            and source.shape.layout != inst.shape.layout:
        return f"{RELAYOUT} {source.name} ({source.shape.layout} -> {inst.shape.layout})"
    return None


def _transposes(inst: hlo.Instruction, by_name) -> bool:
    """Whether `inst` is a copy whose result's minor dimension is not its operand's."""
    if inst.opcode != "copy" or not inst.operands or by_name.get(inst.operands[0]) is None:
        return False
    source = by_name[inst.operands[0]].shape
    if not (isinstance(source, hlo.Leaf) and isinstance(inst.shape, hlo.Leaf) and len(source.dims) > 1):
        return False
    return _minor_dimension(source.layout) != _minor_dimension(inst.shape.layout)


def _minor_dimension(layout: str) -> str:
    """The first entry of a layout's minor-to-major order ("1,0:T(8,128)(2,1)" -> "1")."""
    return layout.split(":")[0].split(",")[0]


def _ragged_dot_windows(inst: hlo.Instruction, computations) -> xla_ragged_dot.Windows | None:
    """The loop of a fusion that computes a ragged dot (its backend config, or a nested fusion's)."""
    pending, seen = [inst], set()
    while pending:
        current = pending.pop()
        if xla_ragged_dot.is_ragged_dot_fusion(current.attributes):
            windows = xla_ragged_dot.parse_windows(current.attributes)
            if windows is not None:
                return windows
        called = hlo.attribute(current.attributes, "calls")
        if called in computations and called not in seen:
            seen.add(called)
            pending.extend(computations[called])
    return None


def _source(name: str, by_name) -> str:
    """The buffer `name` re-describes, looking through bitcasts (e.g. the parameter a prefetch slices)."""
    while name in by_name and by_name[name].opcode == "bitcast" and by_name[name].operands:
        name = by_name[name].operands[0]
    return name


def _partially_read_parameters(called: list[hlo.Instruction]) -> dict[int, int]:
    """Parameters of a fused computation read only through gather / slice ops: bytes those ops produce."""
    parameters = {}
    for inst in called:
        if inst.opcode == "parameter":
            number = re.match(r"\s*(\d+)", inst.arguments)
            parameters[inst.name] = int(number.group(1)) if number else None
    partial = {}
    for name, number in parameters.items():
        users = [inst for inst in called if name in inst.operands]
        if users and all(user.opcode in _SLICING_OPCODES and user.operands[0] == name for user in users):
            partial[number] = sum(sum(leaf.bytes for leaf in hlo.leaves(user.shape)) for user in users)
    return partial
