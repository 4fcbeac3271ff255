"""The suites `kernels benchmark tpu-kernels/attention-tpu --version 1` runs (through the repo's
benchmarks/benchmark.py): flash, paged and latent attention at the shapes we model.

On a TPU host the cases are shapes `tpu-kernels check` compiles (the kernel's `compile_targets`, with
`paged.compile_targets` and `latent.compile_targets`): flash attention at prefill (Qwen3-30B-A3B over 4096 tokens,
Gemma 4 26B-A4B's global layers over 8192) and decode (a batch of 8 against 4096 and 32768 cached tokens, Gemma
4's global layers' batch of 64, GPT-OSS-20B's full layers with sinks), ragged paged attention over transformers'
and vLLM's page sizes (a decode batch of 64 sequences; a 960-token prefill chunk with 64 decode rows), and latent
attention (MLA): the latent kernel's decode over the latent cache (DeepSeek-V3 under TP8, batch 64 over 4096
cached tokens; DeepSeek-V3 whole, 128 heads, batch 8 over 32768; GLM-4.7-Flash, batch 32 over 4096 with a
left-padding mask) and flash attention with key and value head dims apart (the expanded form's prefill of 4096
tokens at DeepSeek-V3's 16 heads under TP8, 192 / 128). A flash or latent case whose arrays are no compile
target's shapes fails as it resolves. Decode lengths, padding and page tables are random (each sequence holding
up to half the longest context). Without a TPU, small shapes in interpret mode. `_benchmark_harness.py` (shipped
into every build) says how a case is timed and checked.

Each case checks its output against the kernel's float64 reference (`reference`), computed once on the host
(the prefill cases' logits take tens of GB of host memory there; the latent decode cases' reference takes a
sequence at a time, its heads as queries: `latent_reference`). Values are scaled so that outputs stay
below 2, where bfloat16's rounding stays within the runner's absolute tolerance of 0.01: the values (v, and the
latent, which is latent attention's values) are scaled by 0.3.
"""

import types

import torch

from . import _benchmark_harness as harness

# Any generation: compile targets' shapes are the same for each.
SHAPES_OF_GENERATION = "v6e"
VALUE_SCALE = 0.3


def declared(table: dict, kernel_shapes) -> dict:
    """`table` with each case checking, as it resolves, that its arrays (`kernel_shapes(spec)`: their shapes, in
    the order the kernel takes them) are those of one of compile_targets' shapes."""
    def checked(name, case):
        def resolve(t):
            spec = case(t)
            shapes = [tuple(shape) for shape in kernel_shapes(spec)]
            if not any([tuple(aval.shape) for aval in avals] == shapes
                       for _, _, avals in t.flash.compile_targets(SHAPES_OF_GENERATION)):
                raise ValueError(f"{name}: arrays of shapes {shapes} are not among compile_targets' shapes")
            return spec
        return resolve

    return {class_name: {name: checked(name, case) for name, case in cases.items()}
            for class_name, cases in table.items()}


def expanded_model(t, tag: str) -> dict:
    """An MLA model's expanded form (compile_targets' EXPANDED_LATENT_HEADS) as flash attention's heads: as many
    KV heads as query heads, keys of one head dim and values of another."""
    heads = t.flash.EXPANDED_LATENT_HEADS[tag]
    return dict(q_heads=heads["q_heads"], kv_heads=heads["q_heads"], head_dim=heads["qk_head_dim"],
                v_head_dim=heads["v_head_dim"])


# Flash attention: class -> workload -> case(targets) -> the model's heads (compile_targets' dicts) and the call's.
FLASH_CASES = {"FlashAttention": {
    "qwen3_prefill_s4096": lambda t: dict(t.flash.QWEN3_30B_A3B, batch=1, q_len=4096, kv_len=4096),
    "qwen3_decode_b8_cache4096": lambda t: dict(t.flash.QWEN3_30B_A3B, batch=8, q_len=1, kv_len=4096, lengths=True),
    "qwen3_decode_b8_cache32768": lambda t: dict(t.flash.QWEN3_30B_A3B, batch=8, q_len=1, kv_len=32768, lengths=True),
    "gemma4_global_prefill_s8192": lambda t: dict(t.flash.GEMMA_4_GLOBAL, batch=1, q_len=t.flash.TOKENS_PER_RANK,
                                                  kv_len=t.flash.TOKENS_PER_RANK),
    "gemma4_global_decode_b64_cache8192": lambda t: dict(t.flash.GEMMA_4_GLOBAL, batch=64, q_len=1,
                                                         kv_len=t.flash.TOKENS_PER_RANK, lengths=True),
    "gpt_oss_decode_b8_cache4096": lambda t: dict(t.flash.GPT_OSS_20B, batch=8, q_len=1, kv_len=4096, lengths=True,
                                                  sinks=True),
    "deepseek_v3_tp8_expanded_prefill_s4096_qk192_v128": lambda t: dict(expanded_model(t, "deepseek-v3 tp8"), batch=1,
                                                                        q_len=4096, kv_len=4096),
}}
# Latent attention (the absorbed form): the model's heads per chip and widths (compile_targets' LATENT_HEADS).
LATENT_CASES = {"LatentAttention": {
    "deepseek_v3_tp8_decode_b64_cache4096": lambda t: dict(t.flash.LATENT_HEADS["deepseek-v3 tp8"], batch=64, q_len=1,
                                                           kv_len=4096, lengths=True),
    "deepseek_v3_decode_b8_cache32768": lambda t: dict(t.flash.LATENT_HEADS["deepseek-v3"], batch=8, q_len=1,
                                                       kv_len=32768, lengths=True),
    "glm_4_7_flash_decode_b32_cache4096_padding_mask": lambda t: dict(t.flash.LATENT_HEADS["glm-4.7-flash"], batch=32,
                                                                      q_len=1, kv_len=4096, padding=True),
}}


def paged_model(t, tag: str) -> dict:
    """A model's paged-attention arguments from compile_targets' one list of shapes: its heads, window and sinks."""
    model = dict(t.flash.HEADS[tag])
    if tag in t.flash.WINDOWS:
        model["sliding_window"] = t.flash.WINDOWS[tag]
    if tag in t.flash.SINKS:
        model["sinks"] = True
    return model


# Ragged paged attention: the model (compile_targets' heads, window, sinks), page size and batch.
PAGED_CASES = {"PagedAttention": {
    "qwen3_page16_decode_b64": lambda t: dict(paged_model(t, "qwen3-30b-a3b"), page_size=16, decode_rows=t.paged.DECODE_BATCH,
                                              prefill_rows=0, max_context=t.paged.MAX_CONTEXT),
    "qwen3_page256_prefill960_decode64": lambda t: dict(
        paged_model(t, "qwen3-30b-a3b"), page_size=256, decode_rows=t.paged.DECODE_BATCH, prefill_rows=t.paged.PREFILL_CHUNK,
        max_context=t.paged.MAX_CONTEXT),
    "gpt_oss_sliding_page128_decode_b64": lambda t: dict(
        paged_model(t, "gpt-oss-20b"), page_size=128, decode_rows=t.paged.DECODE_BATCH, prefill_rows=0,
        max_context=t.paged.MAX_CONTEXT),
    "gemma4_sliding_page256_decode_b64": lambda t: dict(
        paged_model(t, "gemma-4-26b-a4b sliding"), page_size=256, decode_rows=t.paged.DECODE_BATCH, prefill_rows=0,
        max_context=t.paged.MAX_CONTEXT),
}}
SMALL_HEADS = dict(q_heads=4, kv_heads=2, head_dim=128)
INTERPRET_FLASH_CASES = {"InterpretModeFlashAttention": {
    "prefill_s128": lambda t: dict(SMALL_HEADS, batch=1, q_len=128, kv_len=128),
    "decode_b2_cache256": lambda t: dict(SMALL_HEADS, batch=2, q_len=1, kv_len=256, lengths=True, sinks=True),
    "expanded_prefill_s128_qk192_v128": lambda t: dict(q_heads=2, kv_heads=2, head_dim=192, v_head_dim=128, batch=1,
                                                       q_len=128, kv_len=128),
}}
SMALL_LATENT = dict(latent_dim=128, rope_dim=64)
INTERPRET_LATENT_CASES = {"InterpretModeLatentAttention": {
    "decode_b2_cache256": lambda t: dict(SMALL_LATENT, heads=4, batch=2, q_len=1, kv_len=256, lengths=True),
    "decode_128_heads_b1_cache128": lambda t: dict(SMALL_LATENT, heads=128, batch=1, q_len=1, kv_len=128,
                                                   lengths=True),
    "decode_b2_cache256_padding_mask": lambda t: dict(SMALL_LATENT, heads=4, batch=2, q_len=1, kv_len=256,
                                                      padding=True),
}}
INTERPRET_PAGED_CASES = {"InterpretModePagedAttention": {
    "page16_prefill8_decode3": lambda t: dict(SMALL_HEADS, page_size=16, decode_rows=3, prefill_rows=8,
                                              max_context=64),
}}


def flash_shapes(case: dict) -> dict:
    """The flash call's arrays by name, in the order the kernel takes them: q, k, v `[B, H, S, D]` (v of its own
    head dim where the case gives one) and the options: per-sequence key lengths for decode, sinks."""
    batch, q_len, kv_len, head_dim = case["batch"], case["q_len"], case["kv_len"], case["head_dim"]
    shapes = dict(q=(batch, case["q_heads"], q_len, head_dim), k=(batch, case["kv_heads"], kv_len, head_dim),
                  v=(batch, case["kv_heads"], kv_len, case.get("v_head_dim", head_dim)))
    if case.get("lengths"):
        shapes["kv_lengths"] = (batch,)
    if case.get("sinks"):
        shapes["sinks"] = (case["q_heads"],)
    return shapes


def flash_inputs(case: dict, generator: torch.Generator) -> dict:
    """q, k, v and the call's options (`flash_shapes`); decode lengths random in [1, S]."""
    shapes = flash_shapes(case)

    def normal(name, scale=1.0):
        return (scale * torch.randn(shapes[name], generator=generator)).to(torch.bfloat16)

    options = {}
    if "kv_lengths" in shapes:
        options["kv_lengths"] = torch.randint(1, case["kv_len"] + 1, shapes["kv_lengths"], generator=generator,
                                              dtype=torch.int32)
    if "sinks" in shapes:
        options["sinks"] = normal("sinks")
    return dict(q=normal("q"), k=normal("k"), v=normal("v", VALUE_SCALE), options=options)


def latent_shapes(case: dict) -> dict:
    """The latent call's arrays by name, in the order the kernel takes them (as the op passes them): q_latent
    `[B, H, Sq, L]`, q_rope `[B, H, Sq, R]`, the cache's latent `[B, 1, S, L]` and rope `[B, 1, S, R]`, kv_lengths
    `[B]` and, with padding, the mask `[B, 1, Sq, S]`."""
    batch, heads, q_len, kv_len = case["batch"], case["heads"], case["q_len"], case["kv_len"]
    latent_dim, rope_dim = case["latent_dim"], case["rope_dim"]
    shapes = dict(q_latent=(batch, heads, q_len, latent_dim), q_rope=(batch, heads, q_len, rope_dim),
                  latent=(batch, 1, kv_len, latent_dim), rope=(batch, 1, kv_len, rope_dim), kv_lengths=(batch,))
    if case.get("padding"):
        shapes["attention_mask"] = (batch, 1, q_len, kv_len)
    return shapes


def latent_inputs(case: dict, generator: torch.Generator) -> dict:
    """The latent call's arrays (`latent_shapes`): kv_lengths random in [1, S] with `lengths`, else every sequence
    at the cache's length (what the op passes without them); with `padding`, a bool mask of each sequence's left
    padding (up to half the cache) as transformers builds it for a padded batch."""
    shapes = latent_shapes(case)
    batch, kv_len = case["batch"], case["kv_len"]

    def normal(name, scale=1.0):
        return (scale * torch.randn(shapes[name], generator=generator)).to(torch.bfloat16)

    if case.get("lengths"):
        kv_lengths = torch.randint(1, kv_len + 1, (batch,), generator=generator, dtype=torch.int32)
    else:
        kv_lengths = torch.full((batch,), kv_len, dtype=torch.int32)
    options = dict(kv_lengths=kv_lengths)
    if "attention_mask" in shapes:
        padding = torch.randint(0, kv_len // 2 + 1, (batch, 1, 1, 1), generator=generator)
        options["attention_mask"] = (torch.arange(kv_len) >= padding).expand(shapes["attention_mask"]).contiguous()
    return dict(q_latent=normal("q_latent"), q_rope=normal("q_rope"), latent=normal("latent", VALUE_SCALE),
                rope=normal("rope"), options=options)


def latent_reference(reference, inputs: dict) -> torch.Tensor:
    """`reference_latent_attention` of a decode step, a sequence at a time, with the query heads as its queries
    (as the kernel packs them): every head reads the one shared KV head, and a step's one query sits at the
    cache's last position, where causality hides no key, so the step is non-causal attention of H queries over
    that head. Called per head instead, the reference would expand the KV head to every query head in float64
    (at 128 heads over 32768 keys, about 150 GB)."""
    q_latent, q_rope = inputs["q_latent"], inputs["q_rope"]
    batch, heads, q_len, _ = q_latent.shape
    if q_len != 1:
        raise ValueError(f"the latent cases are decode steps (one query per sequence), got {q_len} queries")

    def sequence(b):
        options = {name: value[b:b + 1] for name, value in inputs["options"].items()}
        if "attention_mask" in options:
            options["attention_mask"] = options["attention_mask"].expand(-1, -1, heads, -1)
        out = reference.reference_latent_attention(q_latent[b:b + 1].transpose(1, 2), q_rope[b:b + 1].transpose(1, 2),
                                                   inputs["latent"][b:b + 1], inputs["rope"][b:b + 1], causal=False,
                                                   **options)
        return out.transpose(1, 2)

    return torch.cat([sequence(b) for b in range(batch)])


def paged_inputs(case: dict, generator: torch.Generator) -> dict:
    """Packed q `[T, Hq, D]` (the prefill chunk's rows first, then one row per decode sequence), K and V caches
    `[pages, page size, Hkv, D]` of half the batch's capacity, each sequence's pages drawn at random."""
    page_size, heads, head_dim = case["page_size"], case["kv_heads"], case["head_dim"]
    pages_per_sequence = case["max_context"] // page_size
    query_counts = ([case["prefill_rows"]] if case["prefill_rows"] else []) + [1] * case["decode_rows"]
    sequences = len(query_counts)
    half = case["max_context"] // 2
    kv_lens = torch.tensor([rows + int(torch.randint(0, half - rows + 1, (), generator=generator))
                            for rows in query_counts], dtype=torch.int32)
    pages = sequences * pages_per_sequence // 2
    page_table = torch.zeros(sequences, pages_per_sequence, dtype=torch.int32)
    page_table[:, :pages_per_sequence // 2] = torch.randperm(pages, generator=generator).view(sequences, -1)

    def cache(scale):
        return (scale * torch.randn(pages, page_size, heads, head_dim, generator=generator)).to(torch.bfloat16)

    options = dict(sliding_window=case.get("sliding_window"), max_q_len=max(query_counts))
    if case.get("sinks"):
        options["sinks"] = torch.randn(case["q_heads"], generator=generator)
    return dict(q=torch.randn(sum(query_counts), case["q_heads"], head_dim, generator=generator).to(torch.bfloat16),
                k_cache=cache(1.0), v_cache=cache(0.3),
                cu_q_lens=torch.tensor([0, *query_counts], dtype=torch.int32).cumsum(0).to(torch.int32),
                kv_lens=kv_lens, page_table=page_table, options=options)


def _tensor_options(inputs: dict) -> dict:
    return {name: value for name, value in inputs["options"].items() if value is not None}


class AttentionCase(harness.KernelCase):
    def targets(self, kernel):
        return types.SimpleNamespace(flash=harness.compile_targets_of(kernel),
                                     paged=harness.compile_targets_of(kernel, "paged.compile_targets"))


class FlashCase(AttentionCase):
    def make_inputs(self, spec, generator):
        return flash_inputs(spec, generator)

    def call(self, inputs):
        return self.kernel.flash_attention(inputs["q"], inputs["k"], inputs["v"], **inputs["options"])

    def expected(self, inputs):
        return self.kernel.reference.reference_attention(inputs["q"], inputs["k"], inputs["v"], **inputs["options"])


class PagedCase(AttentionCase):
    def make_inputs(self, spec, generator):
        return paged_inputs(spec, generator)

    def call(self, inputs):
        return self.kernel.ragged_paged_attention(inputs["q"], inputs["k_cache"], inputs["v_cache"],
                                                  inputs["cu_q_lens"], inputs["kv_lens"], inputs["page_table"],
                                                  **_tensor_options(inputs))

    def expected(self, inputs):
        options = {name: value for name, value in _tensor_options(inputs).items() if name != "max_q_len"}
        return self.kernel.reference.reference_paged_attention(
            inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["cu_q_lens"], inputs["kv_lens"],
            inputs["page_table"], **options)


class LatentCase(AttentionCase):
    def make_inputs(self, spec, generator):
        return latent_inputs(spec, generator)

    def call(self, inputs):
        return self.kernel.latent_attention(inputs["q_latent"], inputs["q_rope"], inputs["latent"], inputs["rope"],
                                            **inputs["options"])

    def expected(self, inputs):
        return latent_reference(self.kernel.reference, inputs)


SUITES = [(FlashCase, declared(FLASH_CASES, lambda spec: flash_shapes(spec).values()), INTERPRET_FLASH_CASES),
          (PagedCase, PAGED_CASES, INTERPRET_PAGED_CASES),
          (LatentCase, declared(LATENT_CASES, lambda spec: latent_shapes(spec).values()), INTERPRET_LATENT_CASES)]
