"""tpu-kernels: Pallas TPU kernels as Hub kernels that PyTorch loads in one line."""

from .kernelize import kernelize


def __getattr__(name):
    # jax (binding) and huggingface_hub (loader) load only when asked for: the
    # Hub server needs neither, and huggingface_hub reads HF_ENDPOINT & co. when
    # first imported.
    if name == "get_kernel":
        from .loader import get_kernel

        return get_kernel
    if name == "jax_torch_op":
        from .binding import jax_torch_op

        return jax_torch_op
    raise AttributeError(f"module 'tpu_kernels' has no attribute {name!r}")


__all__ = ["get_kernel", "jax_torch_op", "kernelize"]
