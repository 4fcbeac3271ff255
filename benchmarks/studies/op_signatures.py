"""The programs TorchTPU's strict eager would compile for a piece of torch code, counted on any device.

In its default eager mode (`DEFER_NEVER`) TorchTPU runs each op as a compiled program, found again by a fingerprint
of the op, its inputs' shapes and dtypes and the values of its other arguments (docs/binding.md). `OpSignatures`
records those, as (op, tensor shapes and dtypes, other arguments), while it is active: a signature it has not seen
is a program a TPU would compile. Each new one is attributed to whose Python called the op: ours (a loaded kernel
build, `_<kernel>_<backend>_<hash>`, or the tpu_kernels package), a transformers module, or anything else.

    with OpSignatures() as recorded:
        model(input_ids)
    recorded.new  # [(signature, origin), ...] in the order first seen

`mark()` and `since()` count what a region added: a decode step, a new prompt length.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Signature(NamedTuple):
    op: str
    arguments: tuple  # tensors as ("tensor", shape, dtype), lists and tuples in kind, the rest as values
    keywords: tuple


class New(NamedTuple):
    signature: Signature
    origin: str  # "ours", "transformers" or "other"
    where: str  # the module and line that called the op


def describe(value):
    """An argument as it enters a signature: a tensor by shape and dtype, anything else by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, (list, tuple)):
        return tuple(describe(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# A loaded kernel build's modules (the loader names a build `_<python name>_<backend>_<hash>`), and this package's.
_OURS = re.compile(r"(_\w+_(cpu|tpu)_[0-9a-f]{6,}|tpu_kernels)(\.|$)")


class OpSignatures(TorchDispatchMode):
    """Records each op signature run while active, with the first caller of each new one (module docstring): the
    innermost caller outside torch and this module decides the origin."""

    def __init__(self):
        super().__init__()
        self.seen: set[Signature] = set()
        self.new: list[New] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        signature = Signature(str(func), describe(tuple(args)), tuple((k, describe(v)) for k, v in kwargs.items()))
        if signature not in self.seen:
            self.seen.add(signature)
            self.new.append(New(signature, *self._caller()))
        return func(*args, **kwargs)

    def _caller(self) -> tuple[str, str]:
        frame = sys._getframe(2)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            where = f"{module}:{frame.f_lineno}"
            if module != __name__ and not module.startswith("torch"):
                if _OURS.match(module):
                    return "ours", where
                return ("transformers" if module.startswith("transformers") else "other"), where
            frame = frame.f_back
        return "other", "?"

    def mark(self) -> int:
        """A position in `new`, for `since`."""
        return len(self.new)

    def since(self, mark: int) -> list[New]:
        return self.new[mark:]


def by_origin(new: list[New]) -> dict[str, int]:
    """How many of these new signatures each origin added."""
    return dict(Counter(entry.origin for entry in new))
