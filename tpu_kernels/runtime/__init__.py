"""The runtime shipped into every build: copied into each variant as `_binding.py`, `_hardware.py`, `_tuning.py`,
`_buckets.py` and `_benchmark_harness.py`.

These modules import the standard library, numpy, torch and jax, nothing else (the benchmark harness also
`kernels`, which loads the build): a build carries them to machines that have none of tpu_kernels installed.
"""
