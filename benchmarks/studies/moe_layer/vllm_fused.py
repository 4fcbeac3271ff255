"""vLLM's fused expert-parallel MoE kernel (tpu-inference 0.32.0's `fused_ep_moe`) as the rival `vllm_fused_ep_moe`.

The layer is what vLLM's FUSED_MOE backend runs (tpu_inference/layers/common/moe.py and
process_weights/moe_weights.py): hidden and intermediate sizes padded to
multiples of 256 (the weights once at load time, the tokens per call), the
weights as w13 [E, 2, H, I] and w2 [E, I, H], then one Pallas kernel that
takes the router's logits and does everything else itself: softmax and top-k,
the all-to-all of the picked rows to their experts' ranks, both matmuls, the
all-to-all back and the weighted sum. Under expert parallelism the tokens are
split over the ranks (mesh axis "model"); the kernel's EP is its own, the same
whichever mode transformers would use, so an EP row prices vLLM at that
rank count. Its block sizes are the fastest that fit VMEM (`fused_search`);
vLLM's own pick (`block_sizes`: its tuned table, else its default formula,
with the kernel's own overrides; none of our models is in the table) is
priced beside them.

It compiles ahead of time per generation with its real body (Mosaic's check
is part of the result) on a compile-only mesh of the EP rank count
(`MESH_TOPOLOGIES`, on every supported generation); a shape the kernel refuses
(its ValueError) or the compiler refuses is the row's error. Its one step has
no parallel grid dimension and no core axis, so on v5p it runs on one of the
megacore device's two cores, and is priced so (`perf`: no megacore split).

Why perf's grid replay cannot count it: the kernel has no grid (one step)
and no block specs; it copies everything itself and waits on descriptors
naming only its scratch buffers (`perf.kernel_dmas` counts a copy at its wait
on an HBM operand); its copy sizes and matmul trip counts are the routing it
computes in SMEM (`cdiv(expert size, btc)` loops, one row copy per pick), which
no replay of program ids or scalar prefetch can evaluate. So `replay` counts
its schedule here, from the kernel's code, at the case's global routing
(shapes.global_picks): per token block `bt`, per local expert (every one, with
or without rows), per intermediate block `bf`: the w1 and w3 blocks of each
hidden block `bd1` then the w2 blocks of each `bd2`, each a step whose next
block is fetched while it computes (the kernel's double buffer), its matmuls
in `btc`-row chunks of the expert's rows. The first weight block of each expert
is fetched only after the previous expert ends (the kernel does not prefetch
across experts), and the combine of each token block waits for its gathered
rows: both are boundary steps without compute. The result is a
`perf.PallasCallTraffic`, priced by the same model as every kernel here
(`modelling.timings`: pipelined steps at the generation's step cost, the XLA
ops around it from the compiled program).

Not priced (`NOT_PRICED`, with the counts in each row): the all-to-all rows
to and from other ranks (ICI remote copies) and the barriers between ranks
(the multichip study prices them: `benchmarks.studies.multichip_fused`);
the scalar core's work, which issues two copy descriptors per (token, pick)
for every local expert; the vector work (softmax, top-k, the activation
recomputed per w2 chunk).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import perf
from tpu_kernels.runtime.hardware import round_up

from .shapes import DTYPE, SEED, Case, Model, global_picks
from .vllm_kernels import DEFAULT_FOLDER, load_fused_moe, load_fused_moe_tuning

FUSED = "vllm_fused_ep_moe"
PAD_TO = 256  # vLLM pads both dimensions to this at load time for this kernel
# The compile-only mesh of an EP rank count, per generation (aot.TOPOLOGIES gives the one-device ones). A rank is
# one jax device: a chip on v5e, v6e and v5p (its two cores one megacore device), one of a chip's two cores on
# TPU7x (so eight ranks are four TPU7x chips).
MESH_TOPOLOGIES = {
    ("v6e", 2): "v6e:2x2", ("v6e", 4): "v6e:2x2",  # multichip_fused's smaller EP meshes
    ("v5e", 8): "v5e:2x4", ("v5e", 32): "v5e:4x8", ("v6e", 8): "v6e:2x4", ("v6e", 32): "v6e:4x8",
    ("v5p", 8): "v5p:2x2x2", ("v5p", 32): "v5p:2x4x4", ("tpu7x", 8): "tpu7x:2x2x1", ("tpu7x", 32): "tpu7x:2x2x4",
}
ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu", "clamped_swiglu": "swigluoai"}
NOT_PRICED_ON_CHIP = ("not priced: the scalar core issuing copy descriptors (dma_descriptors) and the vector work "
                      "(softmax, top-k, the activation per w2 chunk)")
NOT_PRICED = {
    "ep1": f"one rank, no cross-device copies; {NOT_PRICED_ON_CHIP}",
    "ep": ("not priced here: the kernel's cross-device part, the all-to-all of picked rows to their experts' ranks "
           "and back (remote copies over ICI: remote_rows) and the barriers between ranks; the figure is this "
           "rank's kernel without them (its local copies of those rows are priced); the multichip study prices "
           "them as it prices ours (multichip.json's fused_ep_moe: collectives.fused_ep_moe_collectives); also "
           f"{NOT_PRICED_ON_CHIP}"),
}
BLOCK_NAMES = ("bt", "bf", "bd1", "bd2", "btc", "bfc", "bd1c", "bd2c")


def padded_dims(model: Model) -> tuple[int, int]:
    return round_up(model.hidden, PAD_TO), round_up(model.intermediate, PAD_TO)


def block_sizes(model: Model, tokens: int, ep: int) -> tuple[dict, str]:
    """vLLM's block sizes for the call, after the kernel's overrides, and where they came from."""
    tuning = load_fused_moe_tuning(DEFAULT_FOLDER)
    hidden, intermediate = padded_dims(model)
    key = (hidden, intermediate, model.experts, model.top_k, 2, 2, tokens, ep)  # bf16 tokens and weights
    source = "tuned table" if key in tuning.TUNED_BLOCK_SIZES else "default formula (not in its tuned table)"
    sizes = dict(zip(BLOCK_NAMES, tuning.get_tuned_block_sizes(*key)))
    local = tokens // ep
    # The kernel's own overrides: a small token count is one block; no block exceeds the tokens.
    if local <= 2 * 8:
        sizes["bt"] = sizes["btc"] = local
    sizes["bt"] = min(local, sizes["bt"])
    sizes["btc"] = min(sizes["bt"], sizes["btc"])
    return sizes, source


def mesh_for(generation: str, ep: int) -> jax.sharding.Mesh:
    from jax.experimental import topologies

    from tpu_kernels.aot import TOPOLOGIES

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    name = TOPOLOGIES[generation] if ep == 1 else MESH_TOPOLOGIES.get((generation, ep))
    if name is None:
        raise ValueError(f"no compile-only topology of {ep} {generation} chips is known here")
    devices = topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    return jax.sharding.Mesh(np.array(devices[:ep]).reshape(1, ep), ("data", "model"))


def layer(hidden, gating, w13, w2, b13=None, b2=None, *, mesh, model: Model, sizes: dict | None = None):
    """vLLM's FUSED_MOE layer: tokens padded to the padded hidden size, the kernel at `sizes` (None: vLLM's own
    pick), the padding sliced off."""
    padded_hidden, _ = padded_dims(model)
    x = jnp.pad(hidden, ((0, 0), (0, padded_hidden - hidden.shape[1])))
    out = load_fused_moe(DEFAULT_FOLDER).fused_ep_moe(
        mesh, x, w13, w2, gating, model.top_k, renormalize_topk_logits=True,
        act_fn=ACTIVATIONS[model.activation], scoring_fn="softmax", b1=b13, b2=b2, **(sizes or {}))
    return out[:, : hidden.shape[1]]


def avals(model: Model, tokens: int, mesh: jax.sharding.Mesh) -> list:
    """The layer's arguments, split over the mesh's EP axis as vLLM shards them."""
    hidden, intermediate = padded_dims(model)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
    shapes = [((tokens, model.hidden), DTYPE), ((tokens, model.experts), DTYPE),
              ((model.experts, 2, hidden, intermediate), DTYPE), ((model.experts, intermediate, hidden), DTYPE)]
    if model.bias:
        shapes += [((model.experts, 2, 1, intermediate), jnp.float32), ((model.experts, 1, hidden), jnp.float32)]
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=split) for shape, dtype in shapes]


def lowering(case: Case, generation: str, sizes: dict | None = None):
    """A function lowering the case's layer at `sizes` (None: vLLM's own pick) for `generation` on its compile-only
    mesh (`Compiler.submit`)."""
    def lower():
        mesh = mesh_for(generation, case.setting.ep)
        with jax.default_device(mesh.devices.flat[0]):
            return jax.jit(lambda *args: layer(*args, mesh=mesh, model=case.model, sizes=sizes)).lower(
                *avals(case.model, case.tokens, mesh))
    return lower


@dataclasses.dataclass(frozen=True)
class Routing:
    """The busiest rank's share of the kernel's work at the case's global routing, per token block."""

    rank: int
    expert_rows: np.ndarray  # [blocks, local experts]: rows each local expert computes (from every rank)
    own_rows: np.ndarray  # [blocks, local experts]: this rank's picks of each local expert slot (any rank's expert)
    remote_rows: int  # rows this rank sends to or receives from another rank, both all-to-alls


def routing(case: Case, bt: int) -> Routing:
    model, ep = case.model, case.setting.ep
    local_experts, local_tokens = case.setting.local_experts, case.tokens // ep
    picks = global_picks(model, case.tokens, SEED)  # [tokens, k] global ids, tokens split over ranks in order
    owner = picks // local_experts
    rank = int(np.argmax(np.bincount(owner.ravel(), minlength=ep)))
    token_rank = np.repeat(np.arange(case.tokens) // local_tokens, model.top_k).reshape(picks.shape)
    block = np.repeat((np.arange(case.tokens) % local_tokens) // bt, model.top_k).reshape(picks.shape)
    blocks = local_tokens // bt
    expert_rows = np.zeros((blocks, local_experts), np.int64)
    mine = owner == rank
    np.add.at(expert_rows, (block[mine], picks[mine] % local_experts), 1)
    own_rows = np.zeros((blocks, local_experts), np.int64)
    own = token_rank == rank
    np.add.at(own_rows, (block[own], picks[own] % local_experts), 1)
    remote = int(np.count_nonzero(mine & ~own) + np.count_nonzero(own & ~mine))
    return Routing(rank, expert_rows, own_rows, 2 * remote)


def _per_step(body: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """One operand's bytes (or a dot's count) per step, in the kernel's order: per token block, its [experts, steps
    of one expert] body, then its two tail steps."""
    blocks = body.shape[0]
    return np.concatenate([body.reshape(blocks, -1), tail], axis=1).ravel().astype(np.int64)


def _schedule(case: Case, sizes: dict, routed: Routing) -> tuple[dict, dict, dict]:
    """Per token block and local expert: a boundary step (the expert's first weight block, not prefetched), its
    w1/w3 then w2 block steps; per token block, the wait for the gathered rows and the combine (module docstring).
    Returns per operand the bytes fetched for and written after each step, and per matmul shape its count."""
    model = case.model
    hidden, intermediate = padded_dims(model)
    row_bytes = hidden * jnp.dtype(DTYPE).itemsize
    bt, bf, bd1, bd2, btc = (sizes[name] for name in ("bt", "bf", "bd1", "bd2", "btc"))
    blocks, experts = routed.expert_rows.shape
    # One expert's steps: the boundary step, then per intermediate block its w1/w3 steps and its w2 steps.
    per_bf = np.r_[np.ones(hidden // bd1, bool), np.zeros(hidden // bd2, bool)]
    w13_step = np.r_[False, np.tile(per_bf, intermediate // bf)]
    w2_step = np.r_[False, np.tile(~per_bf, intermediate // bf)]
    first_w13 = np.r_[False, np.tile(np.arange(per_bf.size) == 0, intermediate // bf)]
    first_bf_w2 = np.r_[False, ~per_bf, np.zeros(per_bf.size * (intermediate // bf - 1), bool)]
    zeros = np.zeros((blocks, experts, w13_step.size), np.int64)
    no_tail = np.zeros((blocks, 2), np.int64)
    own_bytes = routed.own_rows * row_bytes
    tokens, gathered_out = zeros.copy(), zeros.copy()
    tokens[:, :, 0] = own_bytes
    gathered_out[:, :, -1] = own_bytes
    gating = zeros.copy()
    gating[:, 0, 0] = bt * round_up(model.experts, 128) * 2
    tail_in, tail_out = no_tail.copy(), no_tail.copy()
    tail_in[:, 1] = bt * model.top_k * row_bytes
    tail_out[:, 1] = bt * model.hidden * 2
    fetched = {"tokens": _per_step(tokens, no_tail), "w13": _per_step(zeros + w13_step * (2 * bd1 * bf * 2), no_tail),
               "w2": _per_step(zeros + w2_step * (bf * bd2 * 2), no_tail)}
    if model.bias:
        fetched["b13"] = _per_step(zeros + first_w13 * (2 * bf * 4), no_tail)
        fetched["b2"] = _per_step(zeros + first_bf_w2 * (bd2 * 4), no_tail)
    fetched |= {"gating": _per_step(gating, no_tail), "gathered": _per_step(zeros, tail_in),
                "output": _per_step(zeros, no_tail)}
    written = {name: np.zeros_like(steps) for name, steps in fetched.items()}
    written["gathered"] = _per_step(gathered_out, no_tail)
    written["output"] = _per_step(zeros, tail_out)
    chunks = -(-routed.expert_rows // btc)[:, :, None]
    ffn1 = (1, btc, sizes["bd1c"] // 2, sizes["bfc"], "bfloat16", "bfloat16", "DEFAULT")
    ffn2 = (1, btc, sizes["bfc"], sizes["bd2c"] // 2, "bfloat16", "bfloat16", "DEFAULT")
    # Per chunk of btc rows: each packed half of a hidden chunk against each intermediate chunk (w1 and w3).
    ffn1_per_chunk = (bd1 // sizes["bd1c"]) * 2 * (bf // sizes["bfc"]) * 2
    ffn2_per_chunk = (bd2 // sizes["bd2c"]) * 2 * (bf // sizes["bfc"])
    dots = {ffn1: _per_step(chunks * w13_step * ffn1_per_chunk, no_tail)}
    dots[ffn2] = dots.get(ffn2, 0) + _per_step(chunks * w2_step * ffn2_per_chunk, no_tail)
    return fetched, written, dots


def scratch_bytes(case: Case, sizes: dict) -> int:
    """VMEM of the kernel's scratch buffers (its pallas_call's scratch_shapes, bf16 tokens and weights)."""
    hidden, _ = padded_dims(case.model)
    bt, bf, ep = sizes["bt"], sizes["bf"], case.setting.ep
    return (2 * 2 * bt * ep * hidden * 2 + case.model.top_k * bt * hidden * 2 + 2 * bt * round_up(case.model.experts, 128)
            * 2 + 2 * bt * hidden * 2 + 2 * 2 * sizes["bd1"] * bf * 2 + 2 * bf * sizes["bd2"] * 2 + 2 * bt * ep * bf * 4)


def refusal(case: Case, sizes: dict) -> str | None:
    """Why the kernel refuses `sizes` for the case (its own checks, as fused_ep_moe makes them), or None."""
    ep, local = case.setting.ep, case.tokens // case.setting.ep
    hidden, intermediate = padded_dims(case.model)
    if case.tokens % ep or case.model.experts % ep:
        return f"tokens {case.tokens} or experts {case.model.experts} not a multiple of ep_size={ep}"
    checks = [(local % 2 == 0 and sizes["bt"] % 2 == 0 and local % sizes["bt"] == 0,  # two bf16 tokens a row
               f"bt={sizes['bt']} must be even and divide the rank's {local} tokens"),
              (sizes["bt"] % sizes["btc"] == 0, "btc must divide bt"),
              (sizes["bfc"] % 128 == 0 and sizes["bf"] % sizes["bfc"] == 0 and intermediate % sizes["bf"] == 0,
               f"bfc must be a multiple of 128 dividing bf, bf one dividing {intermediate}")]
    checks += [(sizes[c] % 256 == 0 and sizes[b] % sizes[c] == 0 and hidden % sizes[b] == 0,
                f"{c} must be a multiple of 256 dividing {b}, {b} one dividing {hidden}")
               for b, c in (("bd1", "bd1c"), ("bd2", "bd2c"))]
    return next((why for ok, why in checks if not ok), None)


def replay(case: Case, sizes: dict | None = None, source: str = "searched",
           routed: Routing | None = None) -> tuple[perf.ProgramReplay, dict] | None:
    """The kernel's schedule at the case's routing and `sizes` (default: vLLM's own pick) as a replayed call, and
    the row's facts about it; None for sizes the kernel refuses (its error comes from the lowering)."""
    ep = case.setting.ep
    if sizes is None:
        try:
            sizes, source = block_sizes(case.model, case.tokens, ep)
        except AssertionError:
            return None
    if refusal(case, sizes):
        return None
    routed = routed or routing(case, sizes["bt"])
    fetched, written, dots_per_step = _schedule(case, sizes, routed)
    steps = len(fetched["w13"])
    operands = tuple(perf.OperandTraffic(
        origin=name, role="output" if name == "output" else "input", memory_space="hbm", array_shape=(),
        dtype="bfloat16", block_shape=(), buffer_count=0,
        transfers=int(np.count_nonzero(fetched[name] + written[name])), distinct_blocks=0,
        hbm_bytes=int(fetched[name].sum() + written[name].sum()), buffer_bytes=0, revisits=0, pipelined=True,
        fetched_per_step=fetched[name], written_per_step=written[name]) for name in fetched)
    call = perf.PallasCallTraffic(
        name=FUSED, grid=(steps,), dimension_semantics=None, steps=steps, active_steps=steps, operands=operands,
        dots=tuple(perf.DotShape(*key, count=int(counts.sum())) for key, counts in dots_per_step.items()),
        dots_exact=True, scratch_vmem_bytes=scratch_bytes(case, sizes), vmem_limit_bytes=100 << 20,
        cost_estimate=None, notes=("counted from the kernel's schedule at the case's routing (vllm_fused), not "
                                   "replayed from its jaxpr",),
        dots_per_step=dots_per_step)
    blocks, local_experts = routed.expert_rows.shape
    bt, k = sizes["bt"], case.model.top_k
    facts = {
        "block_sizes": sizes, "block_sizes_from": source, "rank": routed.rank,
        "local_tokens": case.tokens // ep, "token_blocks": blocks,
        "expert_rows": int(routed.expert_rows.sum()),
        "weight_passes": blocks,  # every local expert's weights are read once per token block
        "not_priced": NOT_PRICED["ep" if ep > 1 else "ep1"],
        "remote_rows": routed.remote_rows,
        # Two descriptors per (token, pick) of the block for every local expert, two per rank per expert
        # gathered, one per (token, pick) combined.
        "dma_descriptors": blocks * (local_experts * (2 * bt * k + 2 * ep) + bt * k),
    }
    return perf.ProgramReplay((call,), ()), facts
