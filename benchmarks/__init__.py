"""The performance lab: the model of a TPU (`benchmarks.perf`) and the studies built on it (`benchmarks.studies`).

It runs from a checkout of the project (`tpu-kernels bench`, `tpu-kernels calibrate`, `python -m
benchmarks.studies.NAME` from the checkout's root) and is not part of the installed package: nothing in
`tpu_kernels` imports it.
"""
