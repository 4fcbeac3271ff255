"""Tiles per shape and TPU generation, and which kernel serves an experts layer.

Kept apart from the kernels so that tuning changes data, not kernel code.
TPU facts (VMEM, bandwidth, MXU peak, tiling) come from `_hardware.py`.
This module is the one namespace of those choices; each concern has its own
module:

- `gmm_tiles.py`: `TileConfig`, the tiles of the grouped matmul
  (`pallas_gmm.ragged_dot`), from `select_config` (the tuned table, else a
  VMEM-aware heuristic), and the backward's d_lhs tiles.
- `tgmm_tiles.py`: `TgmmConfig`, the tiles of the weights' gradient
  (`pallas_tgmm.tgmm`).
- `fused_tiles.py`: `FusedConfig`, the tiles of the fused experts kernel
  (`pallas_fused.fused_experts`), from `fused_config`.
- `weights_layout.py`: each projection's weights are read in the order XLA
  already stores them (`weights_orientation`), which is not always
  transformers' layout.
- `vmem.py`: the VMEM budget, the bounds on what a grid step unrolls, and the
  buffers each kernel's tiles hold.

Here: `use_fused_experts`, the rule that picks the fused kernel over the two
grouped matmuls for an experts layer.

`plan.py` turns a call's problem into the plan its kernels run, from the
choices made here.
"""

from __future__ import annotations

from .fused_tiles import (
    BIAS_BLOCK_EXPERTS, FUSED_MAX_CHUNK_ROWS, MAX_EXPERTS_PER_STEP, MULTI_EXPERT_MIN_TOKENS,
    SHARED_EXPERTS_MIN_GAIN, FusedConfig, busier_core_seconds, check_fused_config, experts_per_step_saving,
    fused_buffers, fused_chunks, fused_config, fused_feeds_fp8_mxu, fused_vmem_bytes, i_tiles,
)
from .gmm_tiles import (
    D_LHS_ROW_TILE, HEURISTIC_RHS_BLOCK_BYTES, HEURISTIC_ROW_TILE, MAX_GROUPS_PER_STEP, TUNED_TILES, TileConfig,
    TunedKey, check_config, expected_active_groups, heuristic_config, matmul_buffers, n_tile, ridge_rows, row_chunks,
    row_tile_rows, select_config, select_d_lhs_config, vmem_bytes, vmem_limit,
)
from .tgmm_tiles import (
    TGMM_OUTPUT_SHARE, TGMM_ROW_TILE, TgmmConfig, check_tgmm_config, heuristic_tgmm_config, select_tgmm_config,
    tgmm_blocks, tgmm_buffers, tgmm_vmem_bytes, tgmm_vmem_limit,
)
from .vmem import (
    MAX_UNROLLED_MACS, MAX_UNROLLED_MATMULS, Buffer, buffers_bytes, fp8_dequantize_vmem_bytes,
)
from .weights_layout import WeightsOrientation, weights_orientation

__all__ = [
    "BIAS_BLOCK_EXPERTS", "D_LHS_ROW_TILE", "FUSED_MAX_CHUNK_ROWS", "FUSED_MAX_TOKENS", "HEURISTIC_RHS_BLOCK_BYTES",
    "HEURISTIC_ROW_TILE", "MAX_EXPERTS_PER_STEP", "MAX_GROUPS_PER_STEP", "MAX_UNROLLED_MACS", "MAX_UNROLLED_MATMULS",
    "MULTI_EXPERT_MIN_TOKENS", "SHARED_EXPERTS_MIN_GAIN", "TGMM_OUTPUT_SHARE", "TGMM_ROW_TILE", "TUNED_TILES",
    "Buffer", "FusedConfig", "TgmmConfig", "TileConfig", "TunedKey", "WeightsOrientation", "buffers_bytes",
    "busier_core_seconds", "check_config", "check_fused_config", "check_tgmm_config", "expected_active_groups", "experts_per_step_saving",
    "fp8_dequantize_vmem_bytes", "fused_buffers", "fused_chunks", "fused_config", "fused_feeds_fp8_mxu",
    "fused_vmem_bytes", "i_tiles",
    "heuristic_config", "heuristic_tgmm_config", "matmul_buffers", "n_tile", "ridge_rows", "row_chunks",
    "row_tile_rows", "select_config", "select_d_lhs_config", "select_tgmm_config", "tgmm_blocks", "tgmm_buffers",
    "tgmm_vmem_bytes", "tgmm_vmem_limit", "use_fused_experts", "vmem_bytes", "vmem_limit", "weights_orientation",
]

# The fused experts kernel serves calls of at most this many tokens (decode
# batches). It gathers an expert's rows and scatters its results with one-hot
# matmuls against all T tokens: 2 x T x H multiply-adds per row on top of the
# expert's 3 x I x H, so at T = 512 and the I of today's MoE models (704 to
# 2880) at most 49 % more MXU work, which decode (rows per expert far below
# `ridge_rows`, weight streaming the bound) hides; the work grows with T, and
# prefill-sized calls take the two grouped matmuls. 512, not 256: under EP
# token dispatch a rank's call holds the picks sent to it, one per row, and at
# a decode batch of 256 the busiest rank gets more than 256 of them (Qwen3-30B-A3B
# on 8 ranks: 301 in `tpu-kernels bench moe_layer`), which the grouped path served
# at 1.28x its roofline on v6e, the fused kernel at 1.06x.
FUSED_MAX_TOKENS = 512


def use_fused_experts(tokens: int, hidden: int, intermediate: int, num_experts: int, dtype, *,
                      weights_transposed: bool, interleaved: bool, has_bias: bool, weights_dtype=None,
                      generation: str | None = None) -> bool:
    """The rule: the fused kernel for decode-sized calls (T <= FUSED_MAX_TOKENS) whose blocks fit the VMEM of
    `generation` (default: this device's), the two grouped matmuls otherwise (see FUSED_MAX_TOKENS for why)."""
    return tokens <= FUSED_MAX_TOKENS and fused_config(
        tokens, hidden, intermediate, num_experts, dtype, weights_transposed=weights_transposed,
        interleaved=interleaved, has_bias=has_bias, weights_dtype=weights_dtype, generation=generation,
    ) is not None
