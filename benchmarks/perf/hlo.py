"""The text of an optimized XLA HLO module read into computations of instructions, with their shapes' placement.

What `benchmarks.perf.xla_program` reads of a compiled program, from the
module XLA dumps (`*.after_optimizations.txt`): each computation's
instructions with their result shape, opcode, operands and attributes. A
shape is a `Leaf` (one array) or a tuple of shapes; a leaf's memory space
comes from its layout's `S(n)` annotation: none or S(0) = HBM, S(1) = VMEM,
any other (SMEM, sync flags) small on-chip buffers. `estimated_cycles` reads
the cycles XLA's TPU cost model annotated in the after-codegen text.
"""

from __future__ import annotations

import dataclasses
import math
import re

HBM, VMEM, OTHER = "hbm", "vmem", "on_chip"
_ITEMSIZE = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
    "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
}
_UNKNOWN_CYCLES = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of a (possibly tuple) shape."""

    dtype: str
    dims: tuple[int, ...]
    space: str
    layout: str = ""  # minor-to-major order and tiling, e.g. "1,2,0:T(8,128)(2,1)"

    @property
    def bytes(self) -> int:
        return math.ceil(math.prod(self.dims) * _ITEMSIZE.get(self.dtype, 0))


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    shape: object  # Leaf | tuple of shapes
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    arguments: str = ""  # the text inside the operand parentheses, e.g. a parameter's number


_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
# A computation ends with a line "}" (or "}, execution_thread=..." for the SparseCores' computations); a line
# starting with "}" inside an instruction (a kernel's multi-line metadata) does not end it.
_COMPUTATION_END = re.compile(r"^\}(\s*$|, execution_thread=)")
_LEAF = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    computations: dict[str, list[Instruction]] = {}
    entry = None
    current = None
    pending: list[tuple[str, str]] = []  # (name, text) of the current computation's instructions

    def close():
        computations[current] = [_parse_instruction(name, rest) for name, rest in pending]
        pending.clear()

    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and "=" not in line.split("(")[0]:
                current = header.group(2)
                if header.group(1):
                    entry = current
            continue
        if _COMPUTATION_END.match(line):
            close()
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match:
            pending.append((match.group(1), match.group(2)))
        elif pending:
            # An attribute string holding line breaks (a kernel's metadata JSON) continues the instruction.
            name, rest = pending[-1]
            pending[-1] = (name, rest + "\n" + line)
    if entry is None:
        raise ValueError("HLO text has no ENTRY computation")
    return computations, entry


def _parse_instruction(name: str, rest: str) -> Instruction:
    shape, position = parse_shape(rest, 0)
    rest = rest[position:].lstrip()
    opcode_end = rest.index("(")
    opcode = rest[:opcode_end].strip()
    close = _matching(rest, opcode_end)
    arguments = rest[opcode_end + 1 : close]
    operands = tuple(re.findall(r"%([\w.\-]+)", arguments))
    return Instruction(name, shape, opcode, operands, rest[close + 1 :], arguments)


def parse_shape(text: str, position: int):
    """A shape at `text[position:]`: a Leaf or a tuple of shapes; returns it and the position after it."""
    while text[position] == " ":
        position += 1
    if text[position] == "(":
        elements = []
        position += 1
        while True:
            while text[position] in " ,":
                position += 1
            if text.startswith("/*", position):
                position = text.index("*/", position) + 2
                continue
            if text[position] == ")":
                return tuple(elements), position + 1
            element, position = parse_shape(text, position)
            elements.append(element)
    match = _LEAF.match(text, position)
    if match is None:  # token[] and other shapes without arrays
        end = text.find(" ", position)
        return Leaf("token", (), OTHER), len(text) if end < 0 else end
    dims = tuple(int(d) for d in match.group(2).split(",") if d)
    layout = match.group(3) or ""
    space = re.search(r"S\((\d+)\)", layout)
    number = int(space.group(1)) if space else 0
    order = re.sub(r"S\(\d+\)", "", layout.strip("{}"))
    return Leaf(match.group(1), dims, HBM if number == 0 else VMEM if number == 1 else OTHER, order), match.end()


def _matching(text: str, open_position: int) -> int:
    depth = 0
    for position in range(open_position, len(text)):
        char = text[position]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if depth == 0:
                return position
    raise ValueError(f"unbalanced brackets in HLO: {text[:200]}")


def leaves(shape) -> list[Leaf]:
    if isinstance(shape, Leaf):
        return [shape]
    return [leaf for element in shape for leaf in leaves(element)]


def single_space(shape) -> str:
    spaces = {leaf.space for leaf in leaves(shape)}
    return spaces.pop() if len(spaces) == 1 else "mixed"


def attribute(attributes: str, key: str) -> str | None:
    match = re.search(rf"\b{key}=%?([\w.\-]+)", attributes)
    return match.group(1) if match else None


def target(inst: Instruction) -> str | None:
    match = re.search(r'custom_call_target="([^"]+)"', inst.attributes)
    return match.group(1) if match else None


def estimated_cycles(codegen_text: str) -> dict[str, int]:
    """XLA's estimated cycles per instruction name, where the TPU backend annotated a finite estimate."""
    found = {}
    for line in codegen_text.splitlines():
        match = _INSTRUCTION.match(line)
        cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
        if match and cycles and int(cycles.group(1)) != _UNKNOWN_CYCLES:
            found[match.group(1)] = int(cycles.group(1))
    return found
