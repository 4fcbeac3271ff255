"""tpu-kernels: Pallas TPU kernels as Hub kernels that PyTorch loads in one line."""

from .binding import jax_torch_op
from .kernelize import kernelize


def __getattr__(name):
    # huggingface_hub reads HF_ENDPOINT & co. when first imported: import it only when asked for.
    if name == "get_kernel":
        from .loader import get_kernel

        return get_kernel
    raise AttributeError(f"module 'tpu_kernels' has no attribute {name!r}")


__all__ = ["get_kernel", "jax_torch_op", "kernelize"]
