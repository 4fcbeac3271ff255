"""The lab's model shapes are the ones the kernels compile: read from each kernel's compile_targets.py, the one
list of them."""

import pytest

from benchmarks.studies import model_shapes
from tpu_kernels.aot import load_compile_targets
from tpu_kernels.distribution.loader import get_local_kernel


@pytest.mark.parametrize(("repo", "names"), [
    ("attention-tpu", {"HEADS": model_shapes.ATTENTION_HEADS, "WINDOWS": model_shapes.ATTENTION_WINDOWS,
                       "SINKS": model_shapes.ATTENTION_SINKS}),
    ("ragged-dot-tpu", {"MODELS": model_shapes.EXPERTS_MODELS}),
])
def test_the_lab_reads_the_tables_the_built_kernel_compiles(kernel_builds, repo, names):
    targets = load_compile_targets(get_local_kernel(kernel_builds[repo], backend="cpu"))
    assert {name: getattr(targets, name) for name in names} == names


def test_a_table_compile_targets_does_not_assign_is_refused():
    with pytest.raises(LookupError, match="assigns no NO_SUCH_TABLE"):
        model_shapes.compile_targets_literal("attention-tpu", "attention_tpu", "NO_SUCH_TABLE")
