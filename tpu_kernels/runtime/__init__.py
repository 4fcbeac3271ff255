"""The runtime shipped into every build: copied into each variant as `_binding.py`, `_hardware.py`, `_tuning.py`
and `_buckets.py`.

These modules import the standard library, numpy, torch and jax, nothing else: a build carries
them to machines that have none of tpu_kernels installed.
"""
