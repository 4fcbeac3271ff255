"""One process of the compile-cache test: `python compile_cache_probe.py`, printing one JSON line.

It turns the caches on as kernelize does (`keep_compiled_programs`, below XDG_CACHE_HOME), then compiles
and counts through jax's monitoring events: `backend compiles` (every program jax hands its compiler or
its persistent cache), `cache hits` (those read back from the persistent cache) and `cache writes`, for
each of two steps:

* cpu: a torch op of the binding's CPU path (a Pallas kernel in TPU interpret mode, with host callbacks)
  called on a random tensor, and a plain jax program (no callbacks) beside it.
* aot: the same Pallas kernel compiled ahead of time for v6e (compile-only topology).
"""

import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl

from tpu_kernels.aot import compile_for
from tpu_kernels.compile_cache import keep_compiled_programs
from tpu_kernels.runtime.binding import jax_torch_op

EVENTS = {"/jax/compilation_cache/cache_hits": "cache hits", "/jax/compilation_cache/cache_misses": "cache writes"}
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def scaled_rows(x: jax.Array) -> jax.Array:
    block = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2.0 + 1.0),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0] // 8,),
                          in_specs=[block], out_specs=block)(x)


class Counts:
    """jax's monitoring events counted into the current step's dict."""

    def __init__(self):
        self.current = {}
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def step(self) -> dict:
        self.current = dict.fromkeys(["backend compiles", *EVENTS.values()], 0)
        return self.current

    def _event(self, event, **_):
        if event in EVENTS:
            self.current[EVENTS[event]] += 1

    def _duration(self, event, _secs, **__):
        self.current["backend compiles"] += event == BACKEND_COMPILE


def run_on_cpu(x: np.ndarray) -> None:
    op = jax_torch_op("compile_cache_probe::scaled_rows")(scaled_rows)
    assert torch.allclose(op(torch.from_numpy(x)), torch.from_numpy(x * 2 + 1))
    assert np.allclose(jax.jit(lambda a: jnp.tanh(a) + 1)(x), np.tanh(x) + 1, atol=1e-6)


def compile_for_v6e(x: np.ndarray) -> None:
    compile_for(scaled_rows, [jax.ShapeDtypeStruct(x.shape, x.dtype)], "v6e")


def main() -> None:
    counts = Counts()
    keep_compiled_programs()
    x = np.random.default_rng(0).standard_normal((16, 128)).astype(np.float32)
    found = {}
    for mode, run in (("cpu", run_on_cpu), ("aot", compile_for_v6e)):
        step = counts.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run(x)
        step["unread entries"] = [str(w.message) for w in caught
                                  if "Error reading persistent compilation cache" in str(w.message)]
        found[mode] = step
    print(json.dumps(found))


if __name__ == "__main__":
    main()
