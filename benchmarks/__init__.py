"""The performance lab: the model of a TPU (`benchmarks.perf`) and the studies built on it (`benchmarks.studies`).

It runs from a checkout of the project as a tool of its own, `python -m benchmarks NAME [args]` from the checkout's
root (`benchmarks.cli`), and is not part of the installed package: nothing in `tpu_kernels` imports it.
"""
