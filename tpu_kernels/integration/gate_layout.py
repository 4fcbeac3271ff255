"""Interleaved gate/up columns laid out concatenated, once, when kernelize hands a module to the kernel.

GPT-OSS stores `gate_up_proj` with gate and up columns interleaved (gate j
at 2j, up j at 2j + 1) and its bias alike. The grouped matmul applies the
gate in its epilogue only to whole blocks of gate and of up columns (Mosaic
has no lane-strided load), so an interleaved layer leaves the gate to XLA,
which reads and writes every row's 2I columns again. `concatenate_gate_up`
permutes the module's weights and bias in place to [gate | up] and keeps the
module computing the same function everywhere:

- `is_concatenated` becomes True, and the module's `_apply_gate` the same
  gate on the two halves, so every experts implementation transformers
  offers (eager, grouped_mm, ...) computes the same layer as before;
- `state_dict()` gives back the checkpoint's interleaved layout and
  `load_state_dict` takes it (state-dict hooks), so `save_pretrained` writes,
  and loading a checkpoint reads, what the model had before kernelize.

The parameters stay the same objects (an optimizer made before kernelize
keeps them; its state, if any, is not permuted). Weights that are not plain
float tensors (quantized, or distributed tensors whose local columns are a
shard of the whole) are left as they are.
"""

from __future__ import annotations

import types

import torch

GATE_UP_NAMES = ("gate_up_proj", "gate_up_proj_bias")


def _columns_axis(module: torch.nn.Module, name: str) -> int:
    """The axis of 2I: the bias's last; the weights' last when stored [E, H, 2I] (`is_transposed`), else -2."""
    return -1 if name.endswith("_bias") or module.is_transposed else -2


def _interleaved(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """[gate | up] along `axis` -> gate j at 2j, up j at 2j + 1."""
    moved = tensor.movedim(axis, -1)
    return moved.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2).movedim(-1, axis)


def _concatenated(tensor: torch.Tensor, axis: int) -> torch.Tensor:
    """gate j at 2j, up j at 2j + 1 along `axis` -> [gate | up]."""
    moved = tensor.movedim(axis, -1)
    return moved.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2).movedim(-1, axis)


def _concatenated_gate(self: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The module's class's gate, given [gate | up]: the class's own `_apply_gate` reads interleaved columns."""
    return type(self)._apply_gate(self, _interleaved(gate_up, -1))


def _save_interleaved(module, state_dict, prefix, local_metadata) -> None:
    for name in GATE_UP_NAMES:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _interleaved(state_dict[key], _columns_axis(module, name))


def _load_interleaved(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                      error_msgs) -> None:
    for name in GATE_UP_NAMES:
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _concatenated(state_dict[key], _columns_axis(module, name))


def why_kept_interleaved(module: torch.nn.Module) -> str | None:
    """Why `concatenate_gate_up` leaves this interleaved module as it is, or None if it can lay it out."""
    for name in GATE_UP_NAMES:
        parameter = getattr(module, name, None)
        if parameter is None:
            continue
        if not parameter.dtype.is_floating_point or parameter.element_size() == 1:
            return f"{name} is {parameter.dtype}"
        if type(parameter.data) is not torch.Tensor:
            return f"{name} is a {type(parameter.data).__name__}, whose columns may be a shard of the layer's"
        if parameter.shape[_columns_axis(module, name)] % 2:
            return f"{name} has an odd number of gate/up columns"
    return None


def concatenate_gate_up(module: torch.nn.Module) -> None:
    """Lay an interleaved experts module's gate/up columns out concatenated, in place (module docstring).

    The caller checks `why_kept_interleaved` first.
    """
    with torch.no_grad():
        for name in GATE_UP_NAMES:
            parameter = getattr(module, name, None)
            if parameter is not None:
                parameter.copy_(_concatenated(parameter, _columns_axis(module, name)))
    module.is_concatenated = True
    module._apply_gate = types.MethodType(_concatenated_gate, module)
    module.register_state_dict_post_hook(_save_interleaved)
    module.register_load_state_dict_pre_hook(_load_interleaved)
