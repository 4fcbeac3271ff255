"""The shapes the benchmark models: models, expert-parallel settings, token counts and their routing.

Routing: per model and token count, expert popularity ~ Dirichlet(8)
(seeded), each token picks top-k distinct experts by Gumbel-top-k over log
popularity; an EP setting models the busiest rank (it sets the layer's
latency).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.studies.model_shapes import EXPERTS_MODELS
from tpu_kernels.runtime.hardware import tpu_generation


GENERATIONS = ("v5e", "v6e")
DTYPE = jnp.bfloat16
SEED = 0
POPULARITY_CONCENTRATION = 8.0
DECODE_TOKENS = (1, 8, 64, 256)
PREFILL_TOKENS = (2048, 8192)
# The anchor shape (its targets: `targets`), modelled first.
ANCHOR = ("qwen3-30b-a3b EP8 router-masking", 256, "v6e")
# The same rank under Qwen3's own default in transformers (both modes are benchmarked).
ANCHOR_DISPATCH = ("qwen3-30b-a3b EP8 dispatch", 256, "v6e")
# What a run without `--all` models: the anchor's rank in both EP modes at its decode batch, and the same rank
# at the larger prefill, on the default generations.
HEADLINE_SETTINGS = (ANCHOR[0], ANCHOR_DISPATCH[0])
HEADLINE_TOKENS = (ANCHOR[1], PREFILL_TOKENS[-1])


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    activation: str  # "silu" | "gelu_tanh" | "clamped_swiglu"
    # transformers' layouts: gate_up [E, 2I, H], down [E, H, I]; transposed: [E, H, 2I], [E, I, H].
    weights_transposed: bool = False
    interleaved: bool = False  # gate / up in even / odd columns (GPT-OSS)
    bias: bool = False
    alpha: float = 1.0
    limit: float = float("inf")


def compiled_model(name: str) -> Model:
    """Model `name` of the experts kernel's compile targets (`EXPERTS_MODELS`)."""
    shape = EXPERTS_MODELS[name]
    return Model(name, hidden=shape["hidden"], intermediate=shape["intermediate"], experts=shape["experts"],
                 top_k=shape["top_k"], weights_transposed=shape["weights_transposed"], bias=shape["biases"],
                 **shape["gate"])


MODELS = {
    model.name: model
    for model in (
        *map(compiled_model, ("qwen3-30b-a3b", "gemma-4-26b-a4b", "gpt-oss-20b")),
        # Benchmarked beside them, not compiled by `tpu-kernels check`.
        Model("deepseek-v3", hidden=7168, intermediate=2048, experts=256, top_k=8, activation="silu"),
    )
}


@dataclasses.dataclass(frozen=True)
class Setting:
    model: Model
    ep: int
    mode: str  # "local" (no expert parallelism) | "router-masking" | "dispatch"

    @property
    def label(self) -> str:
        return self.model.name if self.ep == 1 else f"{self.model.name} EP{self.ep} {self.mode}"

    @property
    def local_experts(self) -> int:
        return self.model.experts // self.ep


# Each model's EP mode is its transformers default (`base_model_ep_plan`: dispatch for Qwen3-MoE, GPT-OSS and
# DeepSeek-V3, router masking for Gemma 4); Qwen3's EP8 rank also runs router masking, the issue's anchor.
SETTINGS = (
    Setting(MODELS["qwen3-30b-a3b"], 1, "local"),
    Setting(MODELS["qwen3-30b-a3b"], 8, "router-masking"),
    Setting(MODELS["qwen3-30b-a3b"], 8, "dispatch"),
    Setting(MODELS["gemma-4-26b-a4b"], 1, "local"),
    Setting(MODELS["gemma-4-26b-a4b"], 8, "router-masking"),
    Setting(MODELS["gpt-oss-20b"], 1, "local"),
    Setting(MODELS["gpt-oss-20b"], 8, "dispatch"),
    Setting(MODELS["deepseek-v3"], 32, "dispatch"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One experts-layer call on one rank: the routing transformers hands `experts_forward`."""

    setting: Setting
    tokens: int
    top_k_index: np.ndarray  # [rows, k] int32, local ids; other ranks' picks = local expert count

    @property
    def model(self) -> Model:
        return self.setting.model

    @property
    def rows(self) -> int:
        return self.top_k_index.shape[0]

    @property
    def k(self) -> int:
        return self.top_k_index.shape[1]

    @property
    def picks(self) -> int:
        return self.rows * self.k

    @property
    def group_sizes(self) -> np.ndarray:
        local = self.setting.local_experts
        return np.bincount(self.top_k_index.ravel(), minlength=local + 1)[:local].astype(np.int32)

    @property
    def live_picks(self) -> int:
        return int(self.group_sizes.sum())

    @property
    def active_experts(self) -> int:
        return int(np.count_nonzero(self.group_sizes))

    @property
    def phase(self) -> str:
        return "decode" if self.tokens in DECODE_TOKENS else "prefill"

    @property
    def label(self) -> str:
        return f"{self.setting.label} T={self.tokens}"

    def weight_shapes(self, weights_k_n: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """gate_up's and down's shapes as transformers stores them, or [E, K, N] with `weights_k_n`."""
        model, experts = self.model, self.setting.local_experts
        h, i = model.hidden, model.intermediate
        if model.weights_transposed or weights_k_n:
            return (experts, h, 2 * i), (experts, i, h)
        return (experts, 2 * i, h), (experts, h, i)

    def avals(self, concrete_index: bool, weights_k_n: bool = False) -> list:
        """Layer arguments: hidden, top_k_index, top_k_weights, gate_up, down (, biases); abstract but the index.
        The weights as transformers stores them, or [E, K, N] with `weights_k_n` (`rivals.Rival.weights_k_n`)."""
        gate_up, down = self.weight_shapes(weights_k_n)
        index = self.top_k_index if concrete_index else jax.ShapeDtypeStruct(self.top_k_index.shape, jnp.int32)
        args = [
            jax.ShapeDtypeStruct((self.rows, self.model.hidden), DTYPE),
            index,
            jax.ShapeDtypeStruct(self.top_k_index.shape, DTYPE),
            jax.ShapeDtypeStruct(gate_up, DTYPE),
            jax.ShapeDtypeStruct(down, DTYPE),
        ]
        if self.model.bias:
            experts = self.setting.local_experts
            args += [jax.ShapeDtypeStruct((experts, 2 * self.model.intermediate), DTYPE),
                     jax.ShapeDtypeStruct((experts, self.model.hidden), DTYPE)]
        return args

    @property
    def min_bytes(self) -> int:
        model = self.model
        itemsize = jnp.dtype(DTYPE).itemsize
        h, i = model.hidden, model.intermediate
        per_expert = 3 * h * i + ((2 * i + h) if model.bias else 0)
        routing = self.picks * (4 + itemsize)
        return (2 * self.rows * h + self.active_experts * per_expert) * itemsize + routing

    @property
    def useful_flops(self) -> int:
        return 2 * self.live_picks * 3 * self.model.hidden * self.model.intermediate

    def roofline_s(self, generation: str) -> float:
        facts = tpu_generation(generation)
        # The device's peaks: on v5p both TensorCores'.
        return max(self.min_bytes / facts.device_hbm_bytes_per_s, self.useful_flops / facts.device_bf16_flops_per_s)


def global_picks(model: Model, tokens: int, seed: int) -> np.ndarray:
    """[tokens, top_k] expert ids: Dirichlet popularity, Gumbel-top-k per token (module docstring)."""
    rng = np.random.default_rng([seed, tokens, model.experts, model.top_k])
    popularity = rng.dirichlet(np.full(model.experts, POPULARITY_CONCENTRATION))
    scores = np.log(popularity) + rng.gumbel(size=(tokens, model.experts))
    return np.argpartition(-scores, model.top_k - 1, axis=1)[:, : model.top_k].astype(np.int32)


def make_case(setting: Setting, tokens: int, seed: int = SEED) -> Case:
    picks = global_picks(setting.model, tokens, seed)
    local = setting.local_experts
    if setting.ep == 1:
        return Case(setting, tokens, picks)
    rank_of = picks // local
    rank = int(np.argmax(np.bincount(rank_of.ravel(), minlength=setting.ep)))
    on_rank = rank_of == rank
    if setting.mode == "router-masking":
        return Case(setting, tokens, np.where(on_rank, picks - rank * local, local).astype(np.int32))
    # Dispatch: the rank receives its picks from every source rank (transformers' all-to-all), in source order.
    received = picks[on_rank] - rank * local
    return Case(setting, tokens, received.reshape(-1, 1).astype(np.int32))


def make_cases(settings, tokens_list) -> list[Case]:
    return [make_case(setting, tokens) for setting in settings for tokens in tokens_list]


def projections(case: Case) -> list[tuple[str, int, int]]:
    """(name, K, N) of the layer's two grouped matmuls."""
    h, i = case.model.hidden, case.model.intermediate
    return [("gate_up", h, 2 * i), ("down", i, h)]
