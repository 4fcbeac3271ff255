"""The shapes: real models' attention over a paged KV cache, decode batches and mixed prefill + decode batches."""

from __future__ import annotations

import dataclasses

import numpy as np

from benchmarks.studies.model_shapes import ATTENTION_HEADS, ATTENTION_SINKS, AttentionLayer

GENERATIONS = ("v5e", "v6e", "tpu7x")
DECODE_BATCH = 64
# Context lengths of the per-length decode points (every sequence of the batch at that length), and the mixed
# batch's range (lengths drawn uniformly, seed 0).
CONTEXT_LENGTHS = (256, 1024, 4096, 8192)
MIXED_RANGE = (256, 8192)
# vLLM's default block size (16) and its TPU backend's usual 128; transformers' paged cache default (256).
PAGE_SIZES = (16, 128, 256)
# The page size of the per-length points and of the mixed prefill + decode batch.
PLOT_PAGE_SIZE = 128
# A mixed batch: one prefill chunk of PREFILL_CHUNK new tokens over PREFILL_CACHED cached ones, and the decode rows.
PREFILL_CHUNK, PREFILL_CACHED = 1024, 3072
ROOFLINE_TARGET_PCT = 85.0
TARGET_FROM_CONTEXT = 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model(AttentionLayer):
    """A model's attention layer, by the name the tables give it, over one kind of cache (`CACHES`)."""

    name: str
    cache: str = "pages"

    def __post_init__(self):
        if self.cache not in CACHES or (self.cache == "window rings" and self.sliding_window is None):
            raise ValueError(f"{self.name}: cache must be one of {CACHES} (window rings under a window), "
                             f"got {self.cache!r}")

    @property
    def window_ring(self) -> bool:
        return self.cache == "window rings"

    def keys_held(self, q_len: int, kv_len: int) -> int:
        """A sequence's keys in the cache: all of them, or (window rings; varlen keys, which transformers gathers
        from its rings) its new ones and the window's before them."""
        if self.cache == "pages" or self.sliding_window is None:
            return kv_len
        return q_len + min(kv_len - q_len, self.sliding_window - 1)

    def pages_per_seq(self, batch: Batch, page_size: int) -> int:
        """Page table columns: the longest sequence's keys, or a ring of window slots."""
        keys = self.sliding_window if self.window_ring else max(batch.kv_lens)
        return -(-keys // page_size)

    def read_as(self, batch: Batch) -> tuple[Batch, Model]:
        """The (batch, layer) of the call a kernel of plain pages makes over the same keys: each sequence's
        `keys_held`, its queries their last positions (a decode row sees every key its ring holds)."""
        if self.cache == "pages":
            return batch, self
        held = tuple(self.keys_held(q, n) for q, n in zip(batch.q_lens, batch.kv_lens))
        return dataclasses.replace(batch, kv_lens=held), dataclasses.replace(self, cache="pages")


# Where a layer's keys are: vLLM's pages (each sequence's keys at their positions); transformers' sliding-layer
# pages, a ring of the window's slots per sequence (`SlidingAttentionCacheAllocator`: decode batches only); or
# contiguous (varlen) keys as transformers' continuous batching hands them to `flash_attn_varlen_func` (a sliding
# layer: each sequence's window gathered from its ring), at no page size.
CACHES = ("pages", "window rings", "varlen")
GPT_OSS_FULL = {**ATTENTION_HEADS["gpt-oss-20b"], "sinks": "gpt-oss-20b" in ATTENTION_SINKS}
# One layer per model over pages (what `cb_step` prices a serving step on, with transformers' own caches).
LAYERS = (
    Model.of_tag("qwen3-30b-a3b", name="Qwen3-30B-A3B"),
    Model.of_tag("gpt-oss-20b", name="GPT-OSS-20B sliding"),
    Model.of_tag("gemma-4-26b-a4b global", name="Gemma-4-26B-A4B global"),
)
MODELS = (
    *LAYERS[:2],
    Model.of_tag("gpt-oss-20b", name="GPT-OSS-20B sliding, window rings", cache="window rings"),
    Model.of_tag("gpt-oss-20b", name="GPT-OSS-20B sliding, varlen keys", cache="varlen"),
    # GPT-OSS alternates sliding layers with full ones: the same heads and sinks over every key.
    Model(**GPT_OSS_FULL, name="GPT-OSS-20B full"),
    Model(**GPT_OSS_FULL, name="GPT-OSS-20B full, varlen keys", cache="varlen"),
    LAYERS[2],
)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One call: each sequence's new queries and its keys (queries included)."""

    label: str
    kind: str  # "decode" | "mixed"
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    context: int | None = None  # the per-length decode points' length

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)


def decode_batches() -> list[Batch]:
    rng = np.random.default_rng(0)
    mixed = tuple(int(n) for n in rng.integers(MIXED_RANGE[0], MIXED_RANGE[1] + 1, DECODE_BATCH))
    batches = [Batch(f"decode B={DECODE_BATCH} lengths {MIXED_RANGE[0]}..{MIXED_RANGE[1]}", "decode",
                     (1,) * DECODE_BATCH, mixed)]
    batches += [Batch(f"decode B={DECODE_BATCH} length {n}", "decode", (1,) * DECODE_BATCH, (n,) * DECODE_BATCH,
                      context=n) for n in CONTEXT_LENGTHS]
    return batches


def mixed_batch() -> Batch:
    decode = decode_batches()[0]
    return Batch(f"prefill {PREFILL_CHUNK} (+{PREFILL_CACHED} cached) + decode B={DECODE_BATCH}", "mixed",
                 (PREFILL_CHUNK, *decode.q_lens), (PREFILL_CHUNK + PREFILL_CACHED, *decode.kv_lens))


def visible_keys(batch: Batch, model: Model) -> list[tuple[int, int]]:
    """Per sequence: (keys some query sees, visible (query, key) pairs), bottom-right aligned and causal."""
    out = []
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
        positions = np.arange(kv_len - q_len, kv_len)
        first = np.zeros_like(positions) if model.sliding_window is None else np.maximum(
            0, positions - model.sliding_window + 1)
        pairs = int((positions - first + 1).sum())
        out.append((int(kv_len - first.min()), pairs))
    return out


def minimum_bytes(batch: Batch, model: Model, itemsize: int = 2) -> int:
    """K and V rows some query sees read once, q read once, out written once."""
    keys = sum(k for k, _ in visible_keys(batch, model))
    return (2 * keys * model.kv_heads * model.head_dim + 2 * batch.total_q * model.q_heads * model.head_dim) * itemsize


def useful_flops(batch: Batch, model: Model) -> int:
    pairs = sum(p for _, p in visible_keys(batch, model))
    return 4 * pairs * model.q_heads * model.head_dim
