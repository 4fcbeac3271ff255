"""The docs' figure tables, rendered from the benchmarks' JSON: one module per benchmark, named after it.

Each module's `render_markdown(data) -> {section: table}` turns the JSON its
benchmark wrote into markdown tables, one per section; `tpu-kernels bench
report` writes them to `benchmarks/results/<benchmark>.md` under `## section`
headings, and the docs include them as generated blocks. They live apart from
the benchmarks because those import jax and torch, and the report (and its
tests) must run without either.
"""
