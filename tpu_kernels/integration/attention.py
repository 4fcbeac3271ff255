"""kernelize's attention: which modules are attention, whether the kernel serves them, and by which route.

Three routes, the report says which:
* transformers' flash path, by name (a Hub kernel, in inference, for a model that takes a flash kernel):
  `model.set_attn_implementation("<org>/<name>--<commit>--<kernel id>:flash_attn_varlen_func")`, a name that
  resolves in this process to the very module kernelize verified (`distribution.loader.kernels_name`), so both
  `generate` and `generate_batch` run on the kernel.
* `attention_forward` registered in `AttentionInterface` and `AttentionMaskInterface` under one name (a local
  build, TRAINING or TORCH_COMPILE, a model without flash support or one that replaces foreign flash names).
* latent attention, for a model whose attention modules have transformers' `expand_kv` (MLA: DeepSeek-V2/V3,
  Kimi, GLM-4.7-Flash, Mistral 4, ...): the kernel's `serve_latent` makes each such module hand its cached
  latent to the attention function unexpanded, and `latent_attention_forward` (registered as above) runs the
  absorbed form over the latent cache or the expanded form through the flash kernel, whichever the kernel prices
  cheaper for the call's shape (a call that needs gradients: expanded). A module whose `kv_b_proj` cannot be
  folded into its queries (`latent_refusal`) keeps transformers' `expand_kv` and runs the expanded form at every
  call. Registered under a name holding "flash" where transformers' continuous batching pages the model's latent
  cache (`continuous_batching_refusal`), so that `generate_batch` runs on it too, over the packed sequences.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING, Callable

from .report import ReportEntry, mode_refusal

if TYPE_CHECKING:
    import torch
    from kernels import Mode

    from .kernelize import KernelSpec


def latent_modules(model) -> dict[str, torch.nn.Module]:
    """The MLA attention modules of `model`: those whose class has transformers' `expand_kv`."""
    return {name: m for name, m in model.named_modules() if callable(getattr(type(m), "expand_kv", None))}


def attention_modules(model) -> dict[str, torch.nn.Module]:
    """The attention modules of `model`: every `*.self_attn` that is not a container of MLA modules (LongCat-Flash
    keeps two in a `self_attn` list), and every MLA module wherever it sits."""
    latent = latent_modules(model)
    return {name: m for name, m in model.named_modules()
            if name in latent or (name.endswith("self_attn") and not any(n.startswith(f"{name}.") for n in latent))}


def _head_dims(module) -> tuple[int, int] | None:
    """(key, value) head dims the flash kernel sees for `module`: an MLA module's expanded ones (nope + rope, v)."""
    if callable(getattr(type(module), "expand_kv", None)):
        return module.qk_nope_head_dim + module.qk_rope_head_dim, module.v_head_dim
    head_dim = getattr(module, "head_dim", None)
    return None if head_dim is None else (head_dim, head_dim)


def head_dims_refusal(attention: dict, served: Callable[[int, int], bool]) -> str | None:
    """Why the kernel cannot serve these attention modules' head dims, naming only what it cannot serve; None if it
    serves them all. `served(key_dim, value_dim)` says what the kernel serves."""
    without = [name for name, module in attention.items() if _head_dims(module) is None]
    unserved = sorted({dims for module in attention.values() if (dims := _head_dims(module)) is not None
                       and not served(*dims)})
    reasons = []
    if unserved:
        reasons.append("head dims (key, value) " + ", ".join(f"({k}, {v})" for k, v in unserved) + " not served")
    if without:
        reasons.append(f"{len(without)} attention module(s) without a head_dim, e.g. {without[0]} "
                       f"({type(attention[without[0]]).__name__})")
    return "; ".join(reasons) or None


FLASH_FUNCTION = "flash_attn_varlen_func"


def flash_route_refusal(model, spec: KernelSpec, kernel: ModuleType, mode: Mode) -> str | None:
    """Why the attention kernel cannot serve `model` through transformers' flash path (so neither can continuous
    batching); None if it can."""
    from kernels import Mode

    if not hasattr(kernel, FLASH_FUNCTION):
        return f"this version of the kernel has no {FLASH_FUNCTION}"
    if spec.local_path is not None:
        return "a local build folder, which transformers cannot load by name (publish it to a Hub)"
    if Mode.TRAINING in mode or Mode.TORCH_COMPILE in mode:
        return "TRAINING or TORCH_COMPILE, which kernelize serves through attention_forward"
    if not getattr(model, "_supports_flash_attn", False):
        return f"{type(model).__name__} does not support flash attention in transformers"
    from ..distribution.loader import NotServableByNameError

    try:
        name = flash_implementation(spec, kernel)
    except NotServableByNameError as error:
        return f"transformers cannot be pointed at the verified kernel: {error}"
    accepted = getattr(model, "_compatible_flash_implementations", None)
    if accepted is not None and name not in accepted:
        return (f"{type(model).__name__} accepts only the flash kernels {accepted}: transformers would replace ours "
                f"with {accepted[0]}")
    return None


def flash_implementation(spec: KernelSpec, kernel: ModuleType) -> str:
    """The attn_implementation name under which transformers loads `kernel` (loaded by `spec`) as a flash kernel.

    transformers loads it again by name, through plain `kernels`: the name resolves to this very module, verified
    here, however kernels' cache changed since and whatever kernels' environment switches say
    (NotServableByNameError where that cannot be arranged)."""
    from ..distribution.loader import kernels_name

    return f"{kernels_name(kernel, spec.repo)}:{FLASH_FUNCTION}"


class _NoticesWithoutAction(logging.Filter):
    """transformers' flash-path notices that name nothing a user of this kernel can act on: that the kernel has no
    block-table function (transformers 5.25 takes that path on CUDA and XPU only), and a cast of float32 inputs
    "back to torch.float32" (a float32 model's: no cast happens)."""

    MESSAGES = ("does not support block tables", "Casting fp32 inputs back to torch.float32 ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(message in record.getMessage() for message in self.MESSAGES)


def _quiet_flash_notices() -> None:
    flash_logger = logging.getLogger("transformers.modeling_flash_attention_utils")
    if not any(isinstance(f, _NoticesWithoutAction) for f in flash_logger.filters):
        flash_logger.addFilter(_NoticesWithoutAction())


def _check_flash_functions(name: str, kernel: ModuleType) -> None:
    """Refuse to go on if transformers' flash path under `name` holds anything but `kernel`'s functions."""
    from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

    from ..distribution.digest import KernelIntegrityError

    if lazy_import_flash_attention(name)[0][1] is not getattr(kernel, FLASH_FUNCTION):
        raise KernelIntegrityError(f"transformers loaded another module than the verified {kernel.__name__} for "
                                   f"{name}; refusing to run it", [])


def served_head_dims(kernel: ModuleType) -> Callable[[int, int], bool]:
    """What the kernel serves, as `supports_head_dims(key_dim, value_dim)`; a build from before key and value head
    dims could differ lists its one head dims in SUPPORTED_HEAD_DIMS."""
    if hasattr(kernel, "supports_head_dims"):
        return kernel.supports_head_dims
    return lambda key_dim, value_dim: key_dim == value_dim and key_dim in kernel.SUPPORTED_HEAD_DIMS


def _attention_dropout(modules) -> float:
    """The largest attention dropout probability of these attention modules (0.0 without any)."""
    return max((float(getattr(m, "attention_dropout", 0.0) or 0.0) for m in modules), default=0.0)


def _register(model, kernel: ModuleType, function, suffix: str = "") -> None:
    """`function` and the kernel's mask function under one name in transformers' interfaces, selected for `model`.

    transformers treats any name containing "flash" as FlashAttention (2-D masks): the name avoids it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"tpu_kernels_{kernel.__name__.lstrip('_')}{suffix}"
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, kernel.attention_mask)
    model.set_attn_implementation(name)


def continuous_batching_refusal(model, mode: Mode) -> str | None:
    """Why transformers' continuous batching cannot run `model`'s latent attention; None if it can.

    It pages the latent of full-attention MLA layers (`MLACacheAllocator`), sliding-window layers with its plain
    allocator only, and has no cache for DSA indexers or linear attention ("Invalid layer type")."""
    from kernels import Mode
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    if Mode.TRAINING in mode or Mode.TORCH_COMPILE in mode:
        return ("TRAINING or TORCH_COMPILE: continuous batching is for inference, and transformers compiles a model "
                "on a name holding \"flash\" without fullgraph")
    try:
        layer_types = set(group_layers_by_attn_type(model.config.get_text_config()))
    except ValueError as error:  # "Invalid layer type: <the first it has no cache for>"
        return f"transformers' continuous batching has no cache for this model's layers ({error})"
    if layer_types != {"full_attention"}:
        return f"transformers' continuous batching pages only full-attention MLA layers, not {sorted(layer_types)}"
    return None


def latent_flash_implementation(kernel: ModuleType) -> str:
    """The name, holding "flash", of `kernel`'s latent attention for a model continuous batching can serve (no digit
    after "flash": transformers would read it as a flash-attn version)."""
    return f"tpu_kernels_{kernel.__name__.lstrip('_')}_latent_flash"


def _register_latent(model, kernel: ModuleType, batching_refusal: str | None) -> None:
    """`latent_attention_forward` and the kernel's mask function under one name, selected for `model`.

    Continuous batching takes no name but sdpa, eager and those holding "flash"; under a name holding "flash" it
    hands the attention function the packed sequences' lengths and no mask, which `latent_attention_forward`
    serves. A name holding "flash" changes `generate` too (transformers keeps an all-ones 2-D mask for a static
    cache, and gives up `fullgraph` compiling), so a model that continuous batching refuses keeps a name without
    it. `set_attn_implementation` would load a name holding "flash" as a Hub kernel; it goes into the config
    instead, as `set_attn_implementation` puts a registered name there."""
    if batching_refusal is not None:
        _register(model, kernel, kernel.latent_attention_forward, "_latent")
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = latent_flash_implementation(kernel)
    AttentionInterface.register(name, kernel.latent_attention_forward)
    AttentionMaskInterface.register(name, kernel.attention_mask)
    model.config._attn_implementation = name


def _kernelize_latent_attention(model, spec: KernelSpec, kernel: ModuleType, mode: Mode, modules: tuple[str, ...],
                                latent: dict) -> ReportEntry:
    if not hasattr(kernel, "latent_attention_forward"):
        return ReportEntry("attention", False, modules, str(spec),
                           "this version of the kernel has no latent attention (latent_attention_forward)")
    unsupported = mode_refusal(kernel.latent_attention_forward, mode)
    if unsupported:
        return ReportEntry("attention", False, modules, str(spec), unsupported)
    expanded_only = {name: why for name, module in latent.items() if (why := kernel.latent_refusal(module))}
    for name, module in latent.items():
        if name not in expanded_only:
            kernel.serve_latent(module)
    batching_refusal = continuous_batching_refusal(model, mode)
    _register_latent(model, kernel, batching_refusal)
    note = (f"latent attention (MLA) over transformers' latent cache: {len(latent) - len(expanded_only)} module(s) "
            "absorbed for decode and short chunks, expanded once per call for long prefills")
    for why in sorted(set(expanded_only.values())):
        count = sum(1 for reason in expanded_only.values() if reason == why)
        note += f"; {count} module(s) expanded at every call ({why})"
    if batching_refusal is None:
        note += "; generate and generate_batch (over continuous batching's paged latent cache)"
    else:
        note += f"; generate_batch unavailable ({batching_refusal})"
    return ReportEntry("attention", True, modules, str(spec), note=note)


def kernelize_attention(model, spec: KernelSpec, kernel: ModuleType, mode: Mode, device: str) -> ReportEntry:
    """Serve `model`'s attention with `kernel` by the route that fits (module docstring), or say why not."""
    from kernels import Mode

    attention = attention_modules(model)
    modules = tuple(attention)
    if not modules:
        return ReportEntry("attention", False, (), str(spec), "no self_attn modules")
    dropout = _attention_dropout(attention.values())
    if Mode.TRAINING in mode and dropout > 0:
        return ReportEntry("attention", False, modules, str(spec),
                           f"attention dropout {dropout} in TRAINING: the kernel has no dropout")
    from .parallel import uneven_attention_heads

    uneven = uneven_attention_heads(model)
    if uneven:
        return ReportEntry("attention", False, modules, str(spec), uneven)
    refused_head_dims = head_dims_refusal(attention, served_head_dims(kernel))
    if refused_head_dims:
        return ReportEntry("attention", False, modules, str(spec), refused_head_dims)
    latent = {name: module for name, module in attention.items() if name in latent_modules(model)}
    if latent:
        return _kernelize_latent_attention(model, spec, kernel, mode, modules, latent)
    unsupported = mode_refusal(kernel.attention_forward, mode)
    if unsupported:
        return ReportEntry("attention", False, modules, str(spec), unsupported)
    no_flash_route = flash_route_refusal(model, spec, kernel, mode)
    if no_flash_route is None:
        # transformers loads the kernel again by this name, through `kernels`: the module loaded and checked above,
        # from a repo the caller's trust settings have just admitted (hence allow_all_kernels).
        _quiet_flash_notices()
        name = flash_implementation(spec, kernel)
        model.set_attn_implementation(name, allow_all_kernels=True)
        _check_flash_functions(name, kernel)
        return ReportEntry("attention", True, modules, str(spec),
                           note="through transformers' flash path: generate and generate_batch")
    _register(model, kernel, kernel.attention_forward)
    return ReportEntry("attention", True, modules, str(spec),
                       note=f"through attention_forward: generate_batch unavailable ({no_flash_route})")
