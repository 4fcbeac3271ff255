"""Collectives between TPU chips over ICI: time = latency + bytes term, on a 2-D slice without wraparound.

The model the multichip benchmark (`benchmarks.studies.multichip`) prices a MoE
layout's communication with:

- all-reduce of S bytes: a bidirectional ring over a Hamiltonian cycle of the
  mesh (reduce-scatter + all-gather): 2 (N-1)/N S / (2 W); latency
  2 x diameter hops (reduce to one chip and broadcast back);
- all-gather of an S-byte result: (N-1)/N S / (2 W); latency diameter hops;
- all-to-all of b bytes between every ordered pair of chips: bisection bound,
  (N/2)^2 b bytes cross the middle cut each way over `rows` links:
  (N/2)^2 b / (rows W); latency diameter hops. Traffic is spread evenly over
  the destinations.
- W, one link's one-way bandwidth: 1e11 B/s for v6e ("How to Scale Your
  Model", jax-ml/scaling-book, tpus.md, ICI table; Google Cloud's v6e page
  gives 3,584 Gbps of ICI per chip over 4 ports, ~1.1e11 B/s per port).
- topology: v6e-8 is a 2x4 slice (Google Cloud's v6e page), without
  wraparound links (scaling book: only full 16-chip axes wrap on v5e/v6e);
  diameter 4 hops.
- per-hop latency: 1 us central ("~1 us" per hop in the scaling book's worked
  ICI problem), band 0.5 us (the figure that problem states) to 2 us (our
  allowance for collective launch and synchronisation, not sourced).
- a host sync (a device-to-host read inside the layer, as transformers' EP
  dispatch makes): 30 us central, band 10-100 us. NOT sourced: the read
  drains the device's queue and the host must then issue the layer's
  remaining ops; we have no TPU to measure it.

`moe_layer_collectives` lists what one decoder layer issues per chip in each
of transformers 5.22's MoE layouts (read from its
`distributed/expert_parallel.py` and `tensor_parallel.py`):

- `tp` and `ep_router`: one all-reduce of the B x H output;
- `ep_dispatch`: an all-to-all of the per-expert counts, a device-to-host read
  of the split sizes (`.tolist()`), an all-to-all of the picks out and one
  back, and an all-gather of the B x H output (each chip dispatched B/N of
  the tokens: Shard(0));
- every layout, for attention: one all-reduce of B x H after o_proj.

`fused_ep_moe_collectives` lists what vLLM's fused_ep_moe kernel exchanges
itself (its barriers: each the diameter's hops; its ring all-reduce of pick
counts: one-hop copies; its rows out and back per token block: the
all-to-all above) and the layer's output all-gather and attention's
all-reduce around it.

Times are in seconds, bandwidths in bytes per second.
"""

from __future__ import annotations

import dataclasses
import math

from tpu_kernels.runtime.hardware import round_up


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A 2-D slice of chips without wraparound links."""

    rows: int
    cols: int

    @property
    def chips(self) -> int:
        return self.rows * self.cols

    @property
    def diameter(self) -> int:
        return self.rows - 1 + self.cols - 1

    @property
    def bisection_links(self) -> int:
        """Links crossing the cut that halves the longer axis (one per row)."""
        return self.rows


V6E_8 = Mesh(rows=2, cols=4)


@dataclasses.dataclass(frozen=True)
class Ici:
    link_bytes_per_s: float  # one link, one way
    hop_latency_s: float


ICI_LINK_BYTES_PER_S = 1e11  # v6e
HOP_LATENCY_S = {"low": 0.5e-6, "central": 1e-6, "high": 2e-6}
HOST_SYNC_S = {"low": 10e-6, "central": 30e-6, "high": 100e-6}
# The MoE layouts of transformers 5.22 that `moe_layer_collectives` knows.
MOE_MODES = ("tp", "ep_router", "ep_dispatch")
COUNT_BYTES = 8  # transformers counts picks per expert in int64


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str  # "all-reduce" | "all-gather" | "all-to-all" | "host sync"
    bytes: int  # all-reduce / all-gather: the array; all-to-all: bytes per ordered pair of chips
    bandwidth_s: float
    latency_s: float

    @property
    def time_s(self) -> float:
        return self.bandwidth_s + self.latency_s


def all_reduce(name: str, nbytes: int, mesh: Mesh, ici: Ici) -> Collective:
    n = mesh.chips
    bandwidth = 2 * (n - 1) / n * nbytes / (2 * ici.link_bytes_per_s)
    return Collective(name, "all-reduce", nbytes, bandwidth, 2 * mesh.diameter * ici.hop_latency_s)


def all_gather(name: str, nbytes: int, mesh: Mesh, ici: Ici) -> Collective:
    n = mesh.chips
    bandwidth = (n - 1) / n * nbytes / (2 * ici.link_bytes_per_s)
    return Collective(name, "all-gather", nbytes, bandwidth, mesh.diameter * ici.hop_latency_s)


def all_to_all(name: str, bytes_per_pair: int, mesh: Mesh, ici: Ici) -> Collective:
    half = mesh.chips // 2
    bandwidth = half * half * bytes_per_pair / (mesh.bisection_links * ici.link_bytes_per_s)
    return Collective(name, "all-to-all", bytes_per_pair, bandwidth, mesh.diameter * ici.hop_latency_s)


def host_sync(name: str, seconds: float) -> Collective:
    return Collective(name, "host sync", 0, 0.0, seconds)


def moe_layer_collectives(mode: str, batch: int, *, hidden: int, experts: int, top_k: int, mesh: Mesh, ici: Ici,
                          host_sync_s: float, bytes_per_activation: int = 2) -> list[Collective]:
    """The collectives one decoder layer issues per chip in `mode` at `batch` tokens (module docstring)."""
    output = batch * hidden * bytes_per_activation
    attention = all_reduce("attention o_proj all-reduce", output, mesh, ici)
    if mode in ("tp", "ep_router"):
        return [all_reduce("experts all-reduce", output, mesh, ici), attention]
    if mode != "ep_dispatch":
        raise ValueError(f"unknown mode {mode!r}; known: {MOE_MODES}")
    n = mesh.chips
    local_experts = experts // n
    # Each chip dispatches its Shard(0) slice of the tokens (the busiest holds ceil(B / N)), each pick to
    # its expert's chip, destinations spread evenly.
    picks_per_pair = math.ceil(batch / n) * top_k / n
    tokens_per_pair = math.ceil(picks_per_pair * hidden * bytes_per_activation)
    return [
        all_to_all("per-expert counts all-to-all", local_experts * COUNT_BYTES, mesh, ici),
        host_sync("split sizes to the host (.tolist())", host_sync_s),
        all_to_all("picks out all-to-all", tokens_per_pair, mesh, ici),
        all_to_all("results back all-to-all", tokens_per_pair, mesh, ici),
        all_gather("output all-gather", output, mesh, ici),
        attention,
    ]


def barrier(name: str, mesh: Mesh, ici: Ici) -> Collective:
    """Every chip signals every chip and waits for all: the farthest signal's hops."""
    return Collective(name, "barrier", 0, 0.0, mesh.diameter * ici.hop_latency_s)


def neighbour_copy(name: str, nbytes: int, ici: Ici) -> Collective:
    """One chip's copy to the next chip of a ring (one hop, one link)."""
    return Collective(name, "neighbour copy", nbytes, nbytes / ici.link_bytes_per_s, ici.hop_latency_s)


def repeated(collective: Collective, count: int) -> Collective:
    """`collective` issued `count` times one after another."""
    return dataclasses.replace(collective, name=f"{collective.name} x {count}",
                               bandwidth_s=collective.bandwidth_s * count, latency_s=collective.latency_s * count)


def fused_ep_moe_collectives(batch: int, *, hidden: int, experts: int, top_k: int, token_block: int, mesh: Mesh,
                             ici: Ici, bytes_per_activation: int = 2) -> list[Collective]:
    """What vLLM's fused_ep_moe (tpu-inference 0.32.0) exchanges between chips per layer, as the collectives above,
    and the decoder layer's collectives around it.

    Read from its kernel: one barrier at its start; per token block of `token_block` of the chip's B / N tokens,
    a ring all-reduce of the per-expert pick counts (N - 1 rounds, each a barrier and one copy of the padded
    int32 counts to the next chip), a barrier, per local expert its rows scattered to the expert's chip and
    gathered back (one all-to-all each way per block, destinations spread evenly) and a barrier, then two
    barriers. Its output stays split over the chips (Shard(0)), so the layer all-gathers it, as `ep_dispatch`
    does; attention's all-reduce as in every layout. Nothing overlaps the kernel's own work: each barrier
    stalls it.
    """
    n = mesh.chips
    blocks = batch // n // token_block
    rows_per_pair = math.ceil(token_block * top_k / n)
    row_bytes = round_up(hidden, 256) * bytes_per_activation  # vLLM pads the hidden size to 256
    output = batch * hidden * bytes_per_activation
    barriers = 1 + blocks * (n - 1 + 1 + experts // n + 2)
    return [
        repeated(barrier("kernel barrier", mesh, ici), barriers),
        repeated(neighbour_copy("pick counts ring step", round_up(experts, 128) * 4, ici), blocks * (n - 1)),
        repeated(all_to_all("rows to the experts' chips all-to-all", rows_per_pair * row_bytes, mesh, ici), blocks),
        repeated(all_to_all("rows back all-to-all", rows_per_pair * row_bytes, mesh, ici), blocks),
        all_gather("output all-gather", output, mesh, ici),
        all_reduce("attention o_proj all-reduce", output, mesh, ici),
    ]
