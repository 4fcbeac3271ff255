"""vLLM's fused_ep_moe at its best: a search over its block sizes per shape and generation, as ours is searched.

fused_ep_moe takes eight tunable sizes (`vllm_fused.BLOCK_NAMES`): the
rank's token block `bt` and the rows computed at a time `btc`, the
intermediate block `bf`, the hidden blocks of w1/w3 `bd1` and of w2 `bd2`,
and the compute sizes `bfc`, `bd1c`, `bd2c` inside those blocks. vLLM picks
them from its tuned table (two model shapes, none of ours) or its default
formula (`vllm_fused.block_sizes`). The search here takes every size the
kernel accepts (`vllm_fused.refusal`): `bt` any even divisor of the rank's
tokens (the whole rank's tokens where they are at most 16, as the kernel
forces) up to the largest token block of vLLM's own tuned table
(`max_token_block`: the kernel unrolls two copy descriptors per token and
pick of a block into each expert's scatter when it is traced, so its program
grows with `bt`; at 1024 tokens of top-8 one compile ran past 15 minutes),
`btc` bt and its halvings down to 8 rows, `bf` every multiple of 128
dividing the padded intermediate size, `bd1` and `bd2` every multiple of 256
dividing the padded hidden size. The compute sizes equal their blocks: under
the model a chunk's MXU passes round up per chunk (ceil(a / m) + ceil(b / m)
>= ceil((a + b) / m)), so splitting a block into chunks never costs less, and
vLLM's default formula and most of its tuned entries pick them so too.

A config is kept on a generation when its scratch (`vllm_fused.scratch_bytes`)
fits the VMEM budget every kernel here gets (`vmem_budget_bytes`: a core's
VMEM less the compiler's and Mosaic's share); each kept config is priced
standalone on the calibrated model (its counted schedule at the case's
routing, as `tuning.tune_rival` prices the tiled rivals), fastest first.
Configs are priced in order of a lower bound (their steps at the generation's
step cost plus their weight passes at peak HBM bandwidth) and the search
stops where the bound passes the best found. The layer is compiled at the
fastest; a config Mosaic refuses is replaced by the next (`vllm_fused.variant`).
"""

from __future__ import annotations

import itertools

from benchmarks.perf import chip
from tpu_kernels.runtime.hardware import tpu_generation, vmem_budget_bytes

from .modelling import standalone, timings
from .shapes import Case
from .vllm_kernels import DEFAULT_FOLDER, load_fused_moe_tuning
from . import vllm_fused

SMALLEST_BTC = 8  # rows: one sublane tile of the packed 32-bit token rows
# A config Mosaic refuses to compile is replaced by the next fastest, at most this many times.
COMPILE_FALLBACKS = 4


def divisors(total: int, step: int) -> list[int]:
    """Multiples of `step` dividing `total`."""
    return [size for size in range(step, total + 1, step) if total % size == 0]


def max_token_block() -> int:
    """The largest token block `bt` in vLLM's tuned table (from the pinned wheel)."""
    return max(sizes[0] for sizes in load_fused_moe_tuning(DEFAULT_FOLDER).TUNED_BLOCK_SIZES.values())


def candidates(case: Case) -> list[dict]:
    """Every block-size config the kernel accepts for the case (module docstring), compute sizes = blocks."""
    local = case.tokens // case.setting.ep
    if case.tokens % case.setting.ep or local % 2:
        return []
    hidden, intermediate = vllm_fused.padded_dims(case.model)
    token_blocks = [local] if local <= 16 else [bt for bt in divisors(local, 2) if bt <= max_token_block()]
    found = []
    for bt in token_blocks:
        row_chunks = [bt] + [bt >> shift for shift in range(1, bt.bit_length())
                             if bt % (1 << shift) == 0 and bt >> shift >= SMALLEST_BTC]
        for btc, bf, bd1, bd2 in itertools.product(row_chunks, divisors(intermediate, 128), divisors(hidden, 256),
                                                   divisors(hidden, 256)):
            sizes = {"bt": bt, "bf": bf, "bd1": bd1, "bd2": bd2, "btc": btc, "bfc": bf, "bd1c": bd1, "bd2c": bd2}
            if vllm_fused.refusal(case, sizes) is None:
                found.append(sizes)
    return found


def fits(case: Case, sizes: dict, generation: str) -> bool:
    return vllm_fused.scratch_bytes(case, sizes) <= vmem_budget_bytes(generation)


def lower_bound_s(case: Case, sizes: dict, generation: str) -> float:
    """No schedule of these sizes is faster: its steps at the step cost, its weight passes at peak bandwidth."""
    hidden, intermediate = vllm_fused.padded_dims(case.model)
    blocks = case.tokens // case.setting.ep // sizes["bt"]
    experts = case.setting.local_experts
    steps = blocks * (experts * (1 + (intermediate // sizes["bf"]) * (hidden // sizes["bd1"] + hidden // sizes["bd2"]))
                      + 2)
    weights = blocks * experts * 3 * hidden * intermediate * 2
    return steps * chip.grid_step_s(generation) + weights / tpu_generation(generation).hbm_bytes_per_s


def search(case: Case, generation: str) -> dict:
    """The configs that fit `generation`, ranked by standalone modelled seconds as far as the bound lets the
    search go, and how many were searched, fit and priced; vLLM's own pick priced beside them."""
    found = candidates(case)
    fitting = sorted((sizes for sizes in found if fits(case, sizes, generation)),
                     key=lambda sizes: lower_bound_s(case, sizes, generation))
    routings: dict[int, vllm_fused.Routing] = {}
    ranked = []
    for sizes in fitting:
        if ranked and lower_bound_s(case, sizes, generation) >= ranked[0][0]:
            break
        routed = routings.setdefault(sizes["bt"], vllm_fused.routing(case, sizes["bt"]))
        replayed, _ = vllm_fused.replay(case, sizes, routed=routed)
        ranked.append((standalone(replayed, generation).pipelined_time_s, sizes))
        ranked.sort(key=lambda item: item[0])
    vllm = vllm_fused.replay(case)
    vllm_sizes = None if vllm is None else vllm[1]["block_sizes"]
    return {"ranked": ranked, "searched": len(found), "fitting": len(fitting), "priced": len(ranked),
            "vllm_block_sizes": vllm_sizes,
            "vllm_fits": vllm_sizes is not None and fits(case, vllm_sizes, generation),
            "vllm_standalone_us": None if vllm is None else round(
                standalone(vllm[0], generation).pipelined_time_s * 1e6, 3)}


def queue(case: Case, compiler, generations) -> dict:
    """Per generation: the layer compiled (with its body) at the searched best, its counted schedule, and the
    search (the next configs to try if Mosaic refuses it). vLLM's own pick where nothing fits or the kernel
    refuses every config, so the row says why."""
    queued = {}
    for generation in generations:
        found = search(case, generation)
        sizes = found["ranked"][0][1] if found["ranked"] else None
        queued[generation] = (_submit(case, compiler, generation, sizes), sizes, found)
    return queued


def _submit(case: Case, compiler, generation: str, sizes: dict | None):
    return compiler.submit(None, None, generation, lower=vllm_fused.lowering(case, generation, sizes),
                           kind=f"vLLM's fused kernel at {case.phase}")


def variant(case: Case, generation: str, program, sizes: dict | None, found: dict, compiler) -> dict:
    """The fused kernel's entry at the best config Mosaic compiles (at most COMPILE_FALLBACKS more tried), its
    modelled time from its counted schedule, the search's facts, and what the figure leaves out."""
    refused = []
    for _, next_sizes in found["ranked"][1:1 + COMPILE_FALLBACKS]:
        if not isinstance(program, dict):
            break
        refused.append({"block_sizes": sizes, "error": program["error"]})
        sizes = next_sizes
        program = _submit(case, compiler, generation, sizes).result()
    search_facts = {"configs_searched": found["searched"], "configs_fitting_vmem": found["fitting"],
                    "configs_priced": found["priced"], "vllm_block_sizes": found["vllm_block_sizes"],
                    "vllm_standalone_us": found["vllm_standalone_us"], "refused_block_sizes": refused}
    if isinstance(program, dict):
        return {"compiled": False, **program, **search_facts}
    replayed, facts = vllm_fused.replay(case, sizes, "searched" if found["ranked"] else "vLLM's own pick")
    return {"compiled": True, **timings(program, replayed, case, generation),
            "kernel_bodies": "compiled with its body (Mosaic's check made)", **facts, **search_facts}
