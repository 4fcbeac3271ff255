"""tpu-kernels: Pallas TPU kernels as Hub kernels that PyTorch loads in one line."""

from .binding import jax_torch_op

__all__ = ["jax_torch_op"]
