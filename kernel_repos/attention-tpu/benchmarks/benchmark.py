"""`kernels benchmark tpu-kernels/attention-tpu --version 1`: flash and paged attention at the shapes we model.

On a TPU host the cases are shapes `tpu-kernels check` compiles (the kernel's `compile_targets` and
`paged.compile_targets`): flash attention at prefill (Qwen3-30B-A3B over 4096 tokens, Gemma 4 26B-A4B's global
layers over 8192) and decode (a batch of 8 against 4096 and 32768 cached tokens, Gemma 4's global layers' batch
of 64, GPT-OSS-20B's full layers with sinks), and ragged paged attention over transformers' and vLLM's page sizes
(a decode batch of 64 sequences; a 960-token prefill chunk with 64 decode rows). Decode lengths and page
tables are random (each sequence holding up to half the longest context). Without a TPU, small shapes in
interpret mode. `_harness.py` (copied into every build) says how a case is timed and checked.

Each case checks its output against the kernel's float64 reference (`reference`), computed once on the host
(the prefill cases' logits take tens of GB of host memory there). Values are scaled so that outputs stay below 2,
where bfloat16's rounding stays within the runner's absolute tolerance of 0.01.
"""

import importlib.util
import types
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location("_kernel_benchmark_harness", Path(__file__).with_name("_harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

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
}}
# Ragged paged attention: the model (paged.compile_targets' dicts: heads, window, sinks), page size and batch.
PAGED_CASES = {"PagedAttention": {
    "qwen3_page16_decode_b64": lambda t: dict(t.paged.QWEN3_30B_A3B, page_size=16, decode_rows=t.paged.DECODE_BATCH,
                                              prefill_rows=0, max_context=t.paged.MAX_CONTEXT),
    "qwen3_page256_prefill960_decode64": lambda t: dict(
        t.paged.QWEN3_30B_A3B, page_size=256, decode_rows=t.paged.DECODE_BATCH, prefill_rows=t.paged.PREFILL_CHUNK,
        max_context=t.paged.MAX_CONTEXT),
    "gpt_oss_sliding_page128_decode_b64": lambda t: dict(
        t.paged.GPT_OSS_20B, page_size=128, decode_rows=t.paged.DECODE_BATCH, prefill_rows=0,
        max_context=t.paged.MAX_CONTEXT),
    "gemma4_sliding_page256_decode_b64": lambda t: dict(
        t.paged.GEMMA_4_SLIDING, page_size=256, decode_rows=t.paged.DECODE_BATCH, prefill_rows=0,
        max_context=t.paged.MAX_CONTEXT),
}}
SMALL_HEADS = dict(q_heads=4, kv_heads=2, head_dim=128)
INTERPRET_FLASH_CASES = {"InterpretModeFlashAttention": {
    "prefill_s128": lambda t: dict(SMALL_HEADS, batch=1, q_len=128, kv_len=128),
    "decode_b2_cache256": lambda t: dict(SMALL_HEADS, batch=2, q_len=1, kv_len=256, lengths=True, sinks=True),
}}
INTERPRET_PAGED_CASES = {"InterpretModePagedAttention": {
    "page16_prefill8_decode3": lambda t: dict(SMALL_HEADS, page_size=16, decode_rows=3, prefill_rows=8,
                                              max_context=64),
}}


def flash_inputs(case: dict, generator: torch.Generator) -> dict:
    """q, k, v `[B, H, S, D]` and the call's options: per-sequence key lengths for decode, sinks."""
    batch, q_len, kv_len, head_dim = case["batch"], case["q_len"], case["kv_len"], case["head_dim"]

    def normal(heads, length, scale=1.0):
        return (scale * torch.randn(batch, heads, length, head_dim, generator=generator)).to(torch.bfloat16)

    options = {}
    if case.get("lengths"):
        options["kv_lengths"] = torch.randint(1, kv_len + 1, (batch,), generator=generator, dtype=torch.int32)
    if case.get("sinks"):
        options["sinks"] = torch.randn(case["q_heads"], generator=generator).to(torch.bfloat16)
    return dict(q=normal(case["q_heads"], q_len), k=normal(case["kv_heads"], kv_len),
                v=normal(case["kv_heads"], kv_len, scale=0.3), options=options)


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


SUITES = [(FlashCase, FLASH_CASES, INTERPRET_FLASH_CASES), (PagedCase, PAGED_CASES, INTERPRET_PAGED_CASES)]
harness.define(globals(), SUITES)
