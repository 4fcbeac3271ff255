"""The binding study (benchmarks/studies/binding.py) times its stand-ins with our ops' own signatures."""

import inspect

import pytest

from benchmarks.studies import binding as study
from tpu_kernels.distribution.loader import get_local_kernel
from tpu_kernels.runtime.binding import jax_torch_op


def _arguments(schema) -> list[tuple[str, str]]:
    return [(argument.name, str(argument.type)) for argument in schema.arguments]


@pytest.mark.parametrize("op", list(study.DECODE_OPS))
def test_a_stand_in_has_the_schema_of_the_op_it_stands_for(kernel_builds, op):
    """The torch schema the binding gives the stand-in is the built kernel's op's; the study's decode-step
    arguments bind to it, and the stand-in returns its first one."""
    repo, _ = study.DECODE_OPS[op]
    kernel = get_local_kernel(kernel_builds[repo], backend="cpu")
    stand_in = study.stand_in(op)
    registered = jax_torch_op(f"binding_study_test::{op}")(stand_in)
    assert _arguments(registered.op._schema) == _arguments(getattr(kernel._ops.ops, op).default._schema)
    arguments = study.decode_arguments()[op]
    inspect.signature(stand_in).bind(*arguments)
    assert stand_in(*arguments) is arguments[0]


def test_an_op_its_repo_does_not_register_is_refused(monkeypatch):
    monkeypatch.setitem(study.DECODE_OPS, "flash_attention", ("rmsnorm-tpu", "rmsnorm_tpu"))
    with pytest.raises(LookupError, match="registers no torch op 'flash_attention'"):
        study.stand_in("flash_attention")
