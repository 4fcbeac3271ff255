"""tpu-kernels: Pallas TPU kernels as Hub kernels that PyTorch loads in one line.

`import tpu_kernels` loads none of jax, torch_tpu, kernels or huggingface_hub:
the Hub server needs none of them, and huggingface_hub reads HF_ENDPOINT & co.
when first imported. They load with the first call that needs them.
"""

from .distribution.digest import KernelIntegrityError
from .integration.kernelize import kernelize

_LOADER_NAMES = ("get_kernel", "get_local_kernel", "get_locked_kernel", "load_kernel")


def __getattr__(name):
    if name in _LOADER_NAMES:
        from .distribution import loader

        return getattr(loader, name)
    if name == "attention_implementation":
        from .integration.attention_name import attention_implementation

        return attention_implementation
    if name == "precompile":
        from .integration.precompile import precompile

        return precompile
    if name == "jax_torch_op":
        from .runtime.binding import jax_torch_op

        return jax_torch_op
    raise AttributeError(f"module 'tpu_kernels' has no attribute {name!r}")


__all__ = ["KernelIntegrityError", "attention_implementation", "get_kernel", "get_local_kernel", "get_locked_kernel", "jax_torch_op", "kernelize", "load_kernel", "precompile"]
