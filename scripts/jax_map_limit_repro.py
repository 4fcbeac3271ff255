"""jax alone, no tpu-kernels: a process near `vm.max_map_count` dies in native code on its next compile.

XLA:CPU maps each program's object files into the process (three mappings per file), and jax keeps compiled
programs alive. A long process that compiles hundreds of interpret-mode programs reaches Linux's limit on
mappings per process (65530 by default). There LLVM cannot map the next program ("LLVM compilation error:
Cannot allocate memory"), jaxlib turns the failed status into a C++ exception (`xla::ValueOrThrow` in
`PyClient::Compile`), and unwinding that exception segfaults in libgcc's `_Unwind_Find_FDE`: the process dies
with no Python error (issue 75; jax-ml/jax#27201). Seen with jaxlib 0.10.2, the newest on the registry.

This takes the process to the limit at once, with single anonymous pages of alternating protection (so the
kernel cannot merge them), leaving HEADROOM mappings free, then compiles distinct small programs until
something gives. With a headroom of 200 it segfaults (exit 139) within ten programs.

usage: python scripts/jax_map_limit_repro.py HEADROOM
"""

import ctypes
import faulthandler
import sys

import jax
import jax.numpy as jnp
import numpy as np

PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS = 2, 0x20
PAGE = 4096


def mappings_in_use() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def hold_mappings_until(count: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    failed = ctypes.c_void_p(-1).value
    held = 0
    while mappings_in_use() < count:
        for _ in range(max(1, (count - mappings_in_use()) // 2)):
            protection = PROT_READ | (PROT_WRITE if held % 2 else 0)
            if libc.mmap(None, PAGE, protection, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) in (None, failed):
                return
            held += 1


def distinct_program(x, *, k):
    for i in range(4):
        x = jax.lax.optimization_barrier(jnp.sin(x) * (k + i) + jnp.cumsum(x, axis=-1))
    return x


def main() -> None:
    faulthandler.enable()
    headroom = int(sys.argv[1])
    with open("/proc/sys/vm/max_map_count") as limit_file:
        limit = int(limit_file.read())
    x = np.ones((8, 128), np.float32)
    jax.jit(lambda x: x + 1)(x).block_until_ready()  # the backend and its threads exist before the squeeze
    hold_mappings_until(limit - headroom)
    print(f"{mappings_in_use()} of {limit} mappings in use; compiling new programs", flush=True)
    for k in range(1000):
        try:
            jax.jit(distinct_program, static_argnames="k")(x, k=k).block_until_ready()
        except Exception as error:  # a clean Python error is the outcome jax should give; print it and go on
            print(f"program {k}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        print(f"program {k} ran; {mappings_in_use()} mappings", flush=True)


if __name__ == "__main__":
    main()
