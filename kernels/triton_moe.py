"""Triton kernels for `kiln::fused_moe` and `kiln::moe_experts` (registered for CUDA): a
grouped GEMM over experts (`fused_moe` is the softmax router, then `moe_experts`).

One step of a MoE layer has T tokens x top_k (token, expert) pairs. The pairs are grouped by
expert into row blocks of BLOCK_M (each expert's rows padded to a multiple of BLOCK_M, the
padding marked invalid), so every block belongs to one expert; a program multiplies one
block of rows by one BLOCK_N slice of that expert's weights. Two launches:

  1. gate/up: rows of x (gathered by token) x w_gate_up[e] -> silu(gate) * up, both halves
     accumulated by the same program, so the [pairs, 2I] gate/up output never exists;
  2. down: those [pairs, I] rows x w_down[e], scaled by the pair's routing weight.

Prefill-sized steps (`TMA_MIN_ROWS` rows an expert and more, sm_90 and newer) run the same
two GEMMs as sorted-rows kernels instead: the pairs' rows of x are first gathered into expert
order (padding rows included), so every row block is a contiguous slice and both operands of
both GEMMs load through tensor descriptors (TMA) rather than per-row pointers; the gate/up
output stays in that order for the down GEMM, which writes each row to its pair.

The top_k products of a token are then summed (a [T, top_k, H] sum, deterministic: no
atomics), as transformers' batched_mm does. Every expert's weights are read once per row
block that uses it, not once per pair as batched_mm's gather does.

The routing (softmax, top-k, renormalisation) is one kernel (kiln.kernels.triton_moe_router)
and the grouping (a stable sort of the pairs, per-expert counts by scatter_add, prefix sums)
plain torch ops on the device, with shapes fixed by T, E, top_k and BLOCK_M: nothing is read
back to the host, so a step can be captured in a CUDA graph. The number of row blocks is
bounded by cdiv(pairs, BLOCK_M) + min(E, pairs); blocks past the used ones exit at once.

Tiling is chosen per shape (`choose_tiling`): BLOCK_M from the mean rows per expert (1.5x
it, so most experts' rows fit one block and their weights are read once; at least 16, the
smallest tensor-core tile); decode takes BLOCK_N narrowed until the blocks in use
times the column tiles fill the GPU (the work is streaming weights); prefill (many rows per
expert) takes larger row tiles that reuse each weight tile over more rows. With few pairs for
many experts (batch-1 decode; `pair_per_block`) each pair is its own block, taken straight
from the router's expert ids, and the grouping ops are skipped. Prefill steps with several
row blocks per expert order the programs so that groups of row blocks cross every column
tile together (`MoETiling.group_m`): their rows stay in L2 instead of being re-read from
HBM for each column tile. The prefill tiles were swept on the H200 (bench/tune_moe.py); the
decode ones at the Mixtral decode step's 80 rows an expert too (neither smaller row blocks nor
the kernels swapped, the weight tile as the MMA's M side, beat them: bench/RESULTS.md AO1, AO3).

Rounding follows the unfused graph: gate/up and the down projection are rounded to the
model dtype like the bmm outputs, silu's output is rounded before the multiply (as
`kiln::silu_and_mul`), the weighted products are kept in float32 (Mixtral: float32 routing
weights) or rounded to the model dtype (`fp32_weights=False`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kiln.kernels.fp8 import FP8_DTYPE
from kiln.kernels.moe import (ExpertExtras, check_expert_extras, check_fused_moe_args, check_fused_moe_fp8_args,
                              check_moe_experts_args, moe_experts_fp8_reference, moe_experts_grouped_mm,
                              moe_experts_reference)
from kiln.kernels.moe import fused_moe as fused_moe_op
from kiln.kernels.moe import fused_moe_fp8 as fused_moe_fp8_op
from kiln.kernels.moe import moe_experts as moe_experts_op
from kiln.kernels.moe import moe_experts_fp8 as moe_experts_fp8_op
from kiln.kernels.triton_activation import gated_activation
from kiln.kernels.triton_common import max_shared_memory, pdl_launch_args, wait_for_previous_kernel
from kiln.kernels.triton_fp8 import quantize_fp8_gathered_rows_triton
from kiln.kernels.triton_moe_router import route_triton

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class MoETiling:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # Program order: 0 walks every row block for one column tile before the next column tile
    # (a wave shares each weight tile through L2, but re-reads its rows from HBM for every
    # column tile); G > 0 walks G row blocks across all column tiles first, so G blocks' rows
    # stay in L2 while the column tiles pass over them (the grouped order of Triton's matmul
    # tutorial). Prefill-sized steps, whose rows (~270 MB at 16k tokens) far exceed L2, gain.
    group_m: int = 0


# Enough programs to keep every SM of an H200 (132) streaming weights at decode: about two each.
TARGET_PROGRAMS = 256

# Steps with at least this many (token, expert) rows per expert run `moe_experts_grouped_mm`
# (torch's grouped GEMM) instead of these kernels, bf16 on sm_90 and newer only; 0 (the
# default) never does. On the H200 (bench/tune_moe.py, Mixtral-8x7B shape, bench/RESULTS.md
# R3-R4) it was slower than the kernels at 320 tokens (0.82x) and level at 16,384 (0.99x), so
# it stays off; KILN_MOE_GROUPED_MM_MIN_ROWS in the environment (read once, at import) sets it.
GROUPED_MM_MIN_ROWS = int(os.environ.get("KILN_MOE_GROUPED_MM_MIN_ROWS", "0"))

# Steps with at least this many (token, expert) rows per expert run the sorted-rows kernels
# (`_moe_gate_up_tma_kernel`, `_moe_down_tma_kernel`) on sm_90 and newer: the rows gathered
# once into expert order, then every tile loaded by a tensor descriptor (TMA) instead of
# per-row pointers. On the H200 (bench/tune_moe.py --sweeps tma, bench/RESULTS.md AC1-AC2), one
# layer at the default tiling: Mixtral-8x7B shape 19.7 against 21.2 ms at 16,384 tokens (4,096
# rows an expert), 9.95 / 10.63 at 8,192, 5.1-5.3 / 5.34 at 4,096 (1,024 rows), but 2.84 / 2.72
# at 2,048 and 0.87 / 0.83 at 320; Qwen3-MoE-30B-A3B 3.17 / 3.27 at 16,384 tokens (1,024 rows),
# level at 8,192, 1.08 / 1.00 at 4,096. The Mixtral offline run: +3.1% (AC2).
# KILN_MOE_TMA_MIN_ROWS sets it (0: never).
TMA_MIN_ROWS = int(os.environ.get("KILN_MOE_TMA_MIN_ROWS", "1024"))


# FP8 experts (`kiln::fused_moe_fp8`) in steps with at least this many rows an expert (prefill-
# sized) are first widened into 16-bit copies of the layer's experts (`dequantize_experts_triton`,
# one pass: a Mixtral-8x7B layer's 1.41 G expert weights, 1.41 GB read and 2.82 GB written, ~1.1 ms
# at the H200's bandwidth, ~35 ms a step over 32 layers), which the 16-bit kernels (the sorted-rows
# ones on sm_90) then take. The pointer kernels' widening inside their K loops keeps the MMA
# waiting on registers: with FP8 experts the Mixtral offline run fell to 3,060 output tokens/s
# against 4,450 in bf16 (bench/RESULTS.md AD2), its prefill-sized steps the slow ones; with this,
# 3,863 (AD5). Decode-sized steps keep the e4m3 weights, whose half-size reads are what they gain.
# KILN_MOE_FP8_DEQUANT_MIN_ROWS sets it (0: never).
FP8_DEQUANT_MIN_ROWS = int(os.environ.get("KILN_MOE_FP8_DEQUANT_MIN_ROWS", "1024"))


# FP8 experts in steps with at least this many rows an expert run W8A8 on sm_90: the sorted-rows
# kernels over e4m3 rows (each token's hidden state, then each row's SiLU-and-mul output,
# quantized per row, as the dense FP8 projections quantize theirs) and e4m3 experts, on e4m3
# MMAs (twice bf16's rate on Hopper), instead of widening the experts. With 1 (every grouped
# step) the Mixtral offline run made 5,769 output tokens/s against weight-only's 3,824 (bench/
# RESULTS.md AF4-AF5, H200). Below ~24 rows an expert the quantization's extra launches outweigh
# the MMA's rate: one layer's op on an H100 (AM1), weight-only against W8A8 (with W8A8_BLOCK_K),
# at 16 rows an expert Mixtral-8x7B's shape 0.594 / 0.597 ms, Qwen3-MoE-30B-A3B's 0.349 / 0.370,
# GLM-4.5-Air's 0.939 / 1.027, at 12 DeepSeek-V2-Lite's 0.314 / 0.329; at 24 (DeepSeek-V2-Lite,
# 0.426 / 0.355) and 32 (Mixtral 0.870 / 0.608, Qwen3-MoE 0.474 / 0.423, GLM 1.447 / 1.187)
# W8A8 wins. 24 the default since 2026-12-06 (16 for a few hours before: Qwen3-MoE's decode at
# batch 256, 16 rows an expert, ran 4.6% slower W8A8, AL3). Per-pair steps stay weight-only on
# the GEMV kernels. KILN_MOE_FP8_ACTIVATIONS_MIN_ROWS sets it (0: never, weight-only).
FP8_ACTIVATIONS_MIN_ROWS = int(os.environ.get("KILN_MOE_FP8_ACTIVATIONS_MIN_ROWS", "24"))

# W8A8 steps' K tiles: at least 128 e4m3 elements, the 128 bytes a 16-bit tiling's 64 elements
# take (the same shared memory a stage). The 16-bit tilings' 64-element K tiles left the e4m3
# MMAs waiting: one layer's op on an H100 (AM1), 64 -> 128, Mixtral-8x7B's shape 0.654 -> 0.608 ms
# at 32 rows an expert, 0.720 -> 0.676 at 64, 1.496 -> 1.157 at 256, 2.468 -> 1.789 at 512 (585 ->
# 807 TFLOP/s); DeepSeek-V2-Lite's 0.789 -> 0.684 at 192; Qwen3-MoE-30B-A3B's and GLM-4.5-Air's
# 0-5% faster; never slower beyond the timings' noise (0.002 ms).
W8A8_BLOCK_K = 128


def uses_fp8_activations(num_pairs: int, num_experts: int, hidden: torch.Tensor, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor) -> bool:
    """Whether a step over FP8 experts runs W8A8 (see FP8_ACTIVATIONS_MIN_ROWS): 16-bit
    activations on sm_90+, weights a tensor descriptor can take."""
    return _from_rows(FP8_ACTIVATIONS_MIN_ROWS, num_pairs, num_experts) and _sorted_rows_run(hidden, w_gate_up, w_down)


def dequantizes_fp8_experts(num_pairs: int, num_experts: int) -> bool:
    """Whether a step of `num_pairs` rows over FP8 experts widens them first (FP8_DEQUANT_MIN_ROWS)."""
    return _from_rows(FP8_DEQUANT_MIN_ROWS, num_pairs, num_experts)


def uses_grouped_mm(num_pairs: int, num_experts: int, hidden: torch.Tensor) -> bool:
    """Whether a step of `num_pairs` rows goes to `moe_experts_grouped_mm` (see GROUPED_MM_MIN_ROWS)."""
    return (_from_rows(GROUPED_MM_MIN_ROWS, num_pairs, num_experts) and hidden.dtype == torch.bfloat16
            and _on_sm90(hidden))


def _on_sm90(hidden: torch.Tensor) -> bool:
    """A CUDA tensor on sm_90 or newer (the grouped GEMM's and the tensor descriptors' need)."""
    return hidden.device.type == "cuda" and torch.cuda.get_device_capability(hidden.device) >= (9, 0)


def uses_tma(num_pairs: int, num_experts: int, hidden: torch.Tensor, w_gate_up: torch.Tensor,
             w_down: torch.Tensor) -> bool:
    """Whether a step of `num_pairs` rows takes the sorted-rows (tensor descriptor) kernels (see
    TMA_MIN_ROWS): 16-bit weights (what the H200 timed) on CUDA from sm_90, whose rows and
    storage a descriptor can take."""
    return _from_rows(TMA_MIN_ROWS, num_pairs, num_experts) and _sorted_rows_run(hidden, w_gate_up, w_down)


def _from_rows(min_rows: int, num_pairs: int, num_experts: int) -> bool:
    """A step of `num_pairs` rows reaches `min_rows` rows an expert (the gates' thresholds; 0: never)."""
    return min_rows > 0 and num_pairs >= min_rows * num_experts


def _sorted_rows_run(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """The sorted-rows kernels can run: 16-bit activations on CUDA from sm_90, weights whose rows
    and storage a tensor descriptor can take."""
    return hidden.element_size() == 2 and _on_sm90(hidden) and _descriptor_ok(w_gate_up, w_down)


def _descriptor_ok(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """A tensor descriptor's base and rows must start 16-byte aligned: the weights' storage, and
    the hidden and intermediate widths (the gathered rows are allocated aligned)."""
    elem = w_gate_up.element_size()
    return (w_gate_up.shape[2] * elem % 16 == 0 and w_down.shape[2] * elem % 16 == 0
            and w_gate_up.data_ptr() % 16 == 0 and w_down.data_ptr() % 16 == 0)


def pair_per_block(num_pairs: int, num_experts: int) -> bool:
    """Decode with few pairs for many experts: each pair gets its own row block (one valid row
    of BLOCK_M) straight from the router's expert ids, skipping the grouping's ~25 small device
    ops per layer. Pairs rarely share an expert then, so the weights are still read about once
    per pair."""
    return num_pairs <= max(2, num_experts // 2)


def choose_tiling(num_pairs: int, num_experts: int, n: int, k: int, element_size: int = 2,
                  shared_memory: int = 0) -> MoETiling:
    """Tiles for a grouped GEMM of `num_pairs` rows spread over `num_experts` experts, each an
    [n, k] weight (n: output columns; for gate/up, the columns of each half). BLOCK_M depends
    on the pairs and experts only, so both GEMMs of a step agree on the row blocks.
    `shared_memory`: bytes a program may use on the device (0: no limit, as on the H200 the
    tables were swept on and under Triton's interpreter)."""
    rows_per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    # Row blocks big enough that most experts' rows fit in one (routing is uneven: 1.5x the
    # mean), so each expert's weights are read once per step; 16 is tl.dot's smallest tile.
    block_m = min(128, max(16, triton.next_power_of_2(math.ceil(1.5 * rows_per_expert))))
    if block_m <= 64:
        # Decode: bound by streaming the weights. Column tiles narrow enough that the blocks
        # in use (about one per expert touched) times the column tiles fill the GPU.
        blocks = min(num_experts, num_pairs)
        block_n = 64
        while block_n > 16 and blocks * triton.cdiv(n, block_n) < TARGET_PROGRAMS:
            block_n //= 2
        tiling = MoETiling(block_m, block_n, 128 if block_m <= 32 else 64, 4, 4 if block_m <= 32 else 3)
    else:
        # Prefill: reuse each weight tile over many rows. 128 x 128 tiles on 8 warps (the gate/up
        # kernel holds two such float32 accumulators): in the H200 sweep (bench/tune_moe.py,
        # 2026-12-01, I3) one layer's MoE took 3.53 ms against 4.44 with 128 x 64 tiles at
        # Mixtral's shape and 2,048 tokens, 25.2 against 32.7 at 16,384, and 1.16 / 4.41 against
        # 1.61 / 4.66 ms at Qwen3-MoE's. With several row blocks per expert, 16 row blocks cross
        # every column tile before the next 16 (`group_m`) on 3 stages: 21.4 ms against 24.8 at
        # 16,384 tokens, 2.98 against 3.03 at 2,048 (K1). One block per expert (Mixtral's 320-token
        # decode) keeps 4 stages in the plain order: 0.861 ms against 0.873.
        if rows_per_expert > 128:
            tiling = MoETiling(128, 128, 64, 8, 3, group_m=16)
        else:
            tiling = MoETiling(128, 128, 64, 8, 4)
        if shared_memory and _staged_bytes(tiling, element_size) > shared_memory:
            # 192 KB (4 stages) or 144 KB (3) of staged tiles: 4 stages are more than an A100
            # (164 KB) holds, either more than an L4 (99 KB). 128 x 64 tiles on 3 stages: 96 KB.
            tiling = MoETiling(128, 64, 64, 8, 3, group_m=tiling.group_m)
    if element_size > 2:           # keep each tile's bytes (shared memory) as for 2-byte weights
        tiling = replace(tiling, block_k=max(16, tiling.block_k * 2 // element_size))
    return _fit(tiling, n, k)


def _staged_bytes(tiling: MoETiling, element_size: int) -> int:
    """Shared memory the gate/up kernel's pipeline stages (the larger of the two kernels): per
    stage one [BLOCK_M, BLOCK_K] row tile and two [BLOCK_K, BLOCK_N] weight tiles, at 2 bytes
    (wider dtypes halve BLOCK_K, so the bytes stay)."""
    return tiling.num_stages * (tiling.block_m * tiling.block_k + 2 * tiling.block_k * tiling.block_n) * min(2, element_size)


def _fit(tiling: MoETiling, n: int, k: int) -> MoETiling:
    """`tiling` with column and K tiles no wider than the (power-of-two rounded) shape."""
    block_n = min(tiling.block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(tiling.block_k, max(16, triton.next_power_of_2(k)))
    return replace(tiling, block_n=block_n, block_k=block_k)


# Per-pair steps (`pair_per_block`: batch-1 and small-batch decodes of models with many small
# experts) run GEMV kernels (`_moe_gate_up_row_kernel`, `_moe_down_row_kernel`): one pair's row
# of x against a [BLOCK_N, K] slice of its expert, multiply-add in registers, no tensor-core tile.
# A 16-row MMA tile wastes 15 of its rows on one pair, and e4m3 experts widen in its K loop: at
# Qwen3-Next-80B's batch-1 decode (10 of 512 experts, e4m3, [1024, 2048] gate/up and [2048, 512]
# down) the dot kernels took 37 and 23 us a layer, 0.5 TB/s (bench/RESULTS.md AH2). On an H100
# (AH4) one layer's op at batch 1: Qwen3-Next-80B e4m3 72.6 -> ~38-40 us, Qwen3-30B-A3B e4m3 73.1
# -> ~37, bf16 55.5 -> ~53-55; at batch 8 level (bf16 196 / 195, e4m3 135 / 133). KILN_MOE_ROW_KERNELS=0
# turns them off (the dot kernels, as before).
ROW_KERNELS = os.environ.get("KILN_MOE_ROW_KERNELS", "1") != "0"
# Programs a row-kernel launch aims for: about four an SM of an H200, each with its slice's loads
# in flight.
ROW_TARGET_PROGRAMS = 4 * 132


@dataclass(frozen=True)
class RowTiling:
    """The per-pair GEMV kernels' tiles: BLOCK_N output columns (of each half for gate/up) a
    program, BLOCK_K of K a loop step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def row_tiling(num_pairs: int, n: int, k: int, element_size: int = 2, halves: int = 1) -> RowTiling:
    """Tiles of a per-pair GEMV over [n, k] weights (`halves` = 2 for gate/up, whose programs
    read both halves' columns): 256 of K a loop step (the whole K where shorter), 4 warps;
    columns narrowed from 16 while the launch has under ROW_TARGET_PROGRAMS programs (down to
    4). In the H100 sweep (bench/tune_moe_rows.py, bench/RESULTS.md AH4) every tiling of 4-16
    columns, 256-1,024 of K and 4-8 warps came within ~5% of the best at Qwen3-Next-80B's and
    Qwen3-30B-A3B's batch-1 and batch-8 steps; 256 of K on 4 warps was at or near the best in
    each, 512 on 8 up to 7% slower with e4m3 experts at batch 8."""
    block_k = min(256, max(16, triton.next_power_of_2(k)))
    block_n = 16
    while block_n > 4 and num_pairs * triton.cdiv(n, block_n) < ROW_TARGET_PROGRAMS:
        block_n //= 2
    block_n = min(block_n, max(4, triton.next_power_of_2(n)))
    while halves * block_n * block_k > 8192 and block_n > 4:  # a float32 accumulator of <= 64 values a thread
        block_n //= 2
    return RowTiling(block_n, block_k, 4, 3)


@dataclass(frozen=True)
class PairBlocks:
    """The (token, expert) pairs grouped by expert into row blocks of one expert each."""

    sorted_pairs: torch.Tensor   # [num_blocks * block_m] int32: pair index, or num_pairs (padding)
    block_expert: torch.Tensor   # [num_blocks] int32: the block's expert, or -1 (unused block)
    num_blocks: int


def group_pairs(experts: torch.Tensor, num_experts: int, block_m: int) -> PairBlocks:
    """Group the flattened pairs of `experts` [T, top_k] by expert, each expert's rows padded to
    a multiple of `block_m`; device ops only (no host read), shapes fixed by the inputs'."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    # About 20 small device ops (they run per layer per step, so fewer is better):
    sorted_experts, order = torch.sort(flat, stable=True)
    # bounds[e]: the first sorted position of expert e (bounds[E] = num_pairs).
    bounds = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=device))
    counts = bounds[1:] - bounds[:-1]
    padded = (counts + (block_m - 1)) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    # Sorted position i (expert e) goes to padded row (ends[e] - padded[e]) + (i - bounds[e]).
    shift = ends - padded - bounds[:-1]
    dest = torch.arange(num_pairs, device=device) + shift[sorted_experts]
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    return PairBlocks(sorted_pairs=sorted_pairs, block_expert=block_expert, num_blocks=num_blocks)


# Steps of at most this many (token, expert) pairs, over at most GROUPING_KERNEL_MAX_EXPERTS
# experts, group them with one Triton program (`_group_pairs_kernel`) instead of
# `group_pairs`' ~20 small torch ops, which a decode step's CUDA graph replays one after
# another in every MoE layer. On the H200 (bench/RESULTS.md AC5) the grouping of Mixtral's
# 8 experts took 11-14 us against 43-71 us at 8-320 tokens, and one layer's op at 320 tokens
# 0.827 against 0.861 ms; but the Mixtral offline run did not gain (4,454 with it, 4,498
# without, one run each, within the runs' spread), and over Qwen3-MoE's 128 experts the
# one program is far slower (528 against 75 us at 320 tokens): off (0) by default;
# KILN_MOE_GROUPING_KERNEL_MAX_PAIRS=N turns it on.
GROUPING_KERNEL_MAX_PAIRS = int(os.environ.get("KILN_MOE_GROUPING_KERNEL_MAX_PAIRS", "0"))
GROUPING_KERNEL_MAX_EXPERTS = 16


@triton.jit
def _group_pairs_kernel(experts_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks,
                        BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """`group_pairs` in one program: per-expert counts, the padded layout's prefix sums, each
    pair to its slot (stable: its rank among its expert's pairs in order), every other slot
    marked padding, each block's expert. Every slot is written exactly once, so the passes
    need no ordering between their stores."""
    wait_for_previous_kernel(PDL)
    experts = tl.arange(0, E_P2)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        pair = c0 + tl.arange(0, CHUNK)
        expert = tl.load(experts_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    seen = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        pair = c0 + tl.arange(0, CHUNK)
        in_range = pair < num_pairs
        expert = tl.load(experts_ptr + pair, mask=in_range, other=-1).to(tl.int32)
        hit = (expert[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(hit, axis=0) - 1) * hit, axis=1)
        first = tl.sum(hit * (starts + seen)[None, :], axis=1)
        tl.store(sorted_pairs_ptr + first + rank, pair, mask=in_range)
        seen += tl.sum(hit, axis=0)
    # A slot's expert: the first whose end lies past it (experts past num_experts never).
    real_ends = tl.where(experts < num_experts, ends, 2**30)
    for s0 in range(0, num_blocks * BLOCK_M, CHUNK):
        slot = s0 + tl.arange(0, CHUNK)
        owner = tl.sum((real_ends[None, :] <= slot[:, None]).to(tl.int32), axis=1)
        mine = (owner[:, None] == experts[None, :]).to(tl.int32)
        local = slot - tl.sum(mine * starts[None, :], axis=1)
        padding = (owner >= num_experts) | (local >= tl.sum(mine * counts[None, :], axis=1))
        tl.store(sorted_pairs_ptr + slot, tl.full([CHUNK], 0, tl.int32) + num_pairs,
                 mask=(slot < num_blocks * BLOCK_M) & padding)
    for b0 in range(0, num_blocks, CHUNK):
        block = b0 + tl.arange(0, CHUNK)
        owner = tl.sum((real_ends[None, :] <= (block * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + block, tl.where(owner < num_experts, owner, -1), mask=block < num_blocks)


def group_pairs_in_one_kernel(experts: torch.Tensor, num_experts: int, block_m: int) -> PairBlocks:
    """`group_pairs` by `_group_pairs_kernel`: the same blocks, one launch."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    e_p2 = triton.next_power_of_2(num_experts)
    # [CHUNK, E_P2] one-hot tiles: ~8k elements a pass step.
    chunk = max(16, min(1024, 8192 // e_p2))
    _group_pairs_kernel[(1,)](flat, sorted_pairs, block_expert, num_pairs, num_experts, num_blocks,
                              BLOCK_M=block_m, E_P2=e_p2, CHUNK=chunk, num_warps=4,
                              **pdl_launch_args(flat.device, "moe"))
    return PairBlocks(sorted_pairs=sorted_pairs, block_expert=block_expert, num_blocks=num_blocks)


def group_pairs_for_step(experts: torch.Tensor, num_experts: int, block_m: int) -> PairBlocks:
    """The grouping a step runs: one kernel up to GROUPING_KERNEL_MAX_PAIRS pairs over at most
    GROUPING_KERNEL_MAX_EXPERTS experts, else torch ops."""
    if 0 < experts.numel() <= GROUPING_KERNEL_MAX_PAIRS and num_experts <= GROUPING_KERNEL_MAX_EXPERTS:
        return group_pairs_in_one_kernel(experts, num_experts, block_m)
    return group_pairs(experts, num_experts, block_m)


@triton.jit
def _block_rows(pid_m, pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr, PAIR_PER_BLOCK: tl.constexpr):
    """The expert of row block `pid_m` (-1: unused) and its BLOCK_M pair indices (num_pairs:
    padding). PAIR_PER_BLOCK: block i is pair i alone, `block_expert_ptr` the router's ids."""
    lanes = tl.arange(0, BLOCK_M)
    if PAIR_PER_BLOCK:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int32)
        pair = tl.where(lanes == 0, pid_m, num_pairs)
    else:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int32)
        pair = tl.load(pairs_ptr + pid_m * BLOCK_M + lanes)
    return expert, pair


@triton.jit
def _program_tile(num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program of a 1-D grid, in `MoETiling.group_m`'s order."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        pid_m = pid % num_blocks
        pid_n = pid // num_blocks
    else:
        tiles_in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = pid // tiles_in_group * GROUP_M
        size = tl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + pid % tiles_in_group % size
        pid_n = pid % tiles_in_group // size
    return pid_m, pid_n


@triton.jit
def _moe_dot(a, w, acc, IEEE: tl.constexpr):
    """acc + a @ w (a [BLOCK_M, BLOCK_K] row tile, w a [BLOCK_K, BLOCK_N] weight tile). IEEE:
    float32 operands, no TF32 (torch's bmm does not use it by default)."""
    if IEEE:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _gate_up_epilogue(acc_gate, acc_up, expert, cols, N, out_ptr, bias_ptr, alpha, limit,
                      BIAS: tl.constexpr, ACT_OAI: tl.constexpr, ACT_GELU: tl.constexpr = False):
    """The gate/up products (float32) -> the activation (float32), rounded where the model's
    graph rounds: the GEMMs' outputs, the biases' sums (BIAS: `bias_ptr` [E, 2N]), SiLU's (or
    GELU's) output. ACT_OAI: GPT-OSS's clamped SwiGLU (kiln.kernels.moe); ACT_GELU:
    gelu_tanh(gate) * up (Gemma 4); else silu(gate) * up."""
    dt = out_ptr.dtype.element_ty
    gate = acc_gate.to(dt).to(tl.float32)
    up = acc_up.to(dt).to(tl.float32)
    if BIAS:
        bias_cols = bias_ptr + expert.to(tl.int64) * (2 * N) + tl.minimum(cols, N - 1)
        gate = (gate + tl.load(bias_cols).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        up = (up + tl.load(bias_cols + N).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    if ACT_OAI:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
    else:
        act = gated_activation(gate, ACT_GELU).to(dt).to(tl.float32) * up
    return act


@triton.jit
def _down_epilogue(acc, expert, cols, N, a_ptr, bias_ptr, BIAS: tl.constexpr):
    """The down products (float32) rounded to the activations' dtype, plus the expert's bias
    (BIAS: `bias_ptr` [E, N]) rounded likewise; float32 for the routing weight's product."""
    dt = a_ptr.dtype.element_ty
    y = acc.to(dt).to(tl.float32)
    if BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * N + tl.minimum(cols, N - 1)).to(tl.float32)
        y = (y + bias[None, :]).to(dt).to(tl.float32)
    return y


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_blocks, N, K,
                        stride_xt, stride_we, stride_wn, stride_om,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr, PAIR_PER_BLOCK: tl.constexpr,
                        w_scale_ptr, W_FP8: tl.constexpr = False, PDL: tl.constexpr = False,
                        bias_ptr=None, alpha=1.0, limit=0.0,
                        BIAS: tl.constexpr = False, ACT_OAI: tl.constexpr = False, ACT_GELU: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _program_tile(num_blocks, N, BLOCK_N, GROUP_M)
    expert, pair = _block_rows(pid_m, pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M, PAIR_PER_BLOCK)
    if expert < 0:
        return
    valid = pair < num_pairs
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N re-read the last one (no mask in the K loop); they are never stored.
    w_cols = tl.minimum(cols, N - 1).to(tl.int64) * stride_wn
    x_rows = x_ptr + token[:, None] * stride_xt
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + w_cols[None, :]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_up = w_gate + N * stride_wn
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w_ks = ks[:, None]
        if EVEN_K:
            a = tl.load(x_rows + ks[None, :], mask=valid[:, None], other=0.0)
            bg = tl.load(w_gate + w_ks)
            bu = tl.load(w_up + w_ks)
        else:
            a = tl.load(x_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
            bg = tl.load(w_gate + w_ks, mask=w_ks < K, other=0.0)
            bu = tl.load(w_up + w_ks, mask=w_ks < K, other=0.0)
        if W_FP8:  # e4m3 weights widen exactly to the activations' dtype; the channel scale comes after
            bg = bg.to(a.dtype)
            bu = bu.to(a.dtype)
        acc_gate = _moe_dot(a, bg, acc_gate, IEEE)
        acc_up = _moe_dot(a, bu, acc_up, IEEE)
    if W_FP8:
        scale_cols = w_scale_ptr + expert.to(tl.int64) * (2 * N) + tl.minimum(cols, N - 1)
        acc_gate = acc_gate * tl.load(scale_cols)[None, :]
        acc_up = acc_up * tl.load(scale_cols + N)[None, :]
    dt = out_ptr.dtype.element_ty
    act = _gate_up_epilogue(acc_gate, acc_up, expert, cols, N, out_ptr, bias_ptr, alpha, limit, BIAS, ACT_OAI, ACT_GELU)
    out_rows = out_ptr + tl.where(valid, pair, 0).to(tl.int64)[:, None] * stride_om
    tl.store(out_rows + cols[None, :], act.to(dt), mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _moe_down_kernel(a_ptr, w_ptr, weight_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_blocks, N, K,
                     stride_am, stride_we, stride_wn, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     EVEN_K: tl.constexpr, IEEE: tl.constexpr, PAIR_PER_BLOCK: tl.constexpr,
                     w_scale_ptr, W_FP8: tl.constexpr = False, PDL: tl.constexpr = False,
                     bias_ptr=None, BIAS: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _program_tile(num_blocks, N, BLOCK_N, GROUP_M)
    expert, pair = _block_rows(pid_m, pairs_ptr, block_expert_ptr, num_pairs, BLOCK_M, PAIR_PER_BLOCK)
    if expert < 0:
        return
    valid = pair < num_pairs
    safe_pair = tl.where(valid, pair, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + tl.minimum(cols, N - 1).to(tl.int64)[None, :] * stride_wn
    a_rows = a_ptr + safe_pair[:, None] * stride_am
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w_ks = ks[:, None]
        if EVEN_K:
            a = tl.load(a_rows + ks[None, :], mask=valid[:, None], other=0.0)
            b = tl.load(w_cols + w_ks)
        else:
            a = tl.load(a_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
            b = tl.load(w_cols + w_ks, mask=w_ks < K, other=0.0)
        if W_FP8:
            b = b.to(a.dtype)
        acc = _moe_dot(a, b, acc, IEEE)
    if W_FP8:
        acc = acc * tl.load(w_scale_ptr + expert.to(tl.int64) * N + tl.minimum(cols, N - 1))[None, :]
    routing_weight = tl.load(weight_ptr + safe_pair, mask=valid, other=0.0).to(tl.float32)
    y = _down_epilogue(acc, expert, cols, N, a_ptr, bias_ptr, BIAS) * routing_weight[:, None]
    out_rows = out_ptr + safe_pair[:, None] * stride_om
    tl.store(out_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


@triton.jit
def _moe_gate_up_row_kernel(x_ptr, w_ptr, out_ptr, experts_ptr, N, K, stride_xt, stride_we, stride_wn, stride_om,
                            w_scale_ptr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN_K: tl.constexpr, W_FP8: tl.constexpr = False, PDL: tl.constexpr = False,
                            bias_ptr=None, alpha=1.0, limit=0.0, BIAS: tl.constexpr = False,
                            ACT_OAI: tl.constexpr = False, ACT_GELU: tl.constexpr = False):
    """One pair's gate/up (`ROW_KERNELS`): x[pair // TOP_K] against BLOCK_N columns of each
    half of its expert's w_gate_up, the activation of the two into out[pair, cols]."""
    wait_for_previous_kernel(PDL)
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N re-read the last one (no mask in the K loop); they are never stored.
    w_gate = w_ptr + expert * stride_we + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn
    w_up = w_gate + N * stride_wn
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_row + ks)
            wg = tl.load(w_gate + ks[None, :])
            wu = tl.load(w_up + ks[None, :])
        else:
            x = tl.load(x_row + ks, mask=ks < K, other=0.0)
            wg = tl.load(w_gate + ks[None, :], mask=ks[None, :] < K, other=0.0)
            wu = tl.load(w_up + ks[None, :], mask=ks[None, :] < K, other=0.0)
        x = x.to(tl.float32)[None, :]
        acc_gate += wg.to(tl.float32) * x
        acc_up += wu.to(tl.float32) * x
    gate = tl.sum(acc_gate, axis=1)[None, :]
    up = tl.sum(acc_up, axis=1)[None, :]
    if W_FP8:
        scale_cols = w_scale_ptr + expert * (2 * N) + tl.minimum(cols, N - 1)
        gate = gate * tl.load(scale_cols)[None, :]
        up = up * tl.load(scale_cols + N)[None, :]
    act = _gate_up_epilogue(gate, up, expert, cols, N, out_ptr, bias_ptr, alpha, limit, BIAS, ACT_OAI, ACT_GELU)
    out_row = out_ptr + pair.to(tl.int64) * stride_om
    tl.store(out_row + cols[None, :], act.to(out_ptr.dtype.element_ty), mask=cols[None, :] < N)


@triton.jit
def _moe_down_row_kernel(a_ptr, w_ptr, weight_ptr, out_ptr, experts_ptr, N, K, stride_am, stride_we, stride_wn,
                         stride_om, w_scale_ptr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         W_FP8: tl.constexpr = False, PDL: tl.constexpr = False, bias_ptr=None,
                         BIAS: tl.constexpr = False):
    """One pair's down projection (`ROW_KERNELS`): its activation row against BLOCK_N rows of its
    expert's w_down, times the pair's routing weight, into out[pair, cols]."""
    wait_for_previous_kernel(PDL)
    pair = tl.program_id(0)
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + expert * stride_we + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_wn
    a_row = a_ptr + pair.to(tl.int64) * stride_am
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_row + ks)
            w = tl.load(w_rows + ks[None, :])
        else:
            a = tl.load(a_row + ks, mask=ks < K, other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)[None, :]
    if W_FP8:
        y = y * tl.load(w_scale_ptr + expert * N + tl.minimum(cols, N - 1))[None, :]
    y = _down_epilogue(y, expert, cols, N, a_ptr, bias_ptr, BIAS) * tl.load(weight_ptr + pair).to(tl.float32)
    out_row = out_ptr + pair.to(tl.int64) * stride_om
    tl.store(out_row + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=cols[None, :] < N)


@triton.jit
def _sorted_block(num_blocks, N, block_expert_ptr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's row block, column tile and the block's expert (-1: an unused block)."""
    pid_m, pid_n = _program_tile(num_blocks, N, BLOCK_N, GROUP_M)
    return pid_m, pid_n, tl.load(block_expert_ptr + pid_m).to(tl.int32)


@triton.jit
def _moe_gate_up_tma_kernel(x_desc, w_desc, out_ptr, block_expert_ptr, num_blocks, N, K, stride_om,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                            a_scale_ptr=None, w_scale_ptr=None, SCALED: tl.constexpr = False,
                            bias_ptr=None, alpha=1.0, limit=0.0, BIAS: tl.constexpr = False,
                            ACT_OAI: tl.constexpr = False, ACT_GELU: tl.constexpr = False):
    """`_moe_gate_up_kernel` over rows already in expert order (row block i = rows i*BLOCK_M..,
    padding rows included): x [rows, K] and w_gate_up as [E * 2N, K] through tensor
    descriptors. Tiles past N (or K) read the next rows (or TMA's zeros) and are never stored.
    SCALED: e4m3 rows and experts (e4m3 MMAs), the products scaled after the K loop by each
    row's scale (`a_scale_ptr`, [rows]) and each expert channel's (`w_scale_ptr`, [E, 2N])."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n, expert = _sorted_block(num_blocks, N, block_expert_ptr, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_M
    gate0 = expert * (2 * N) + pid_n * BLOCK_N
    up0 = gate0 + N
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([row0, k0])
        bg = w_desc.load([gate0, k0])
        bu = w_desc.load([up0, k0])
        acc_gate = _moe_dot(a, bg.T, acc_gate, IEEE)
        acc_up = _moe_dot(a, bu.T, acc_up, IEEE)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SCALED:
        row_scale = tl.load(a_scale_ptr + rows)[:, None]
        scale_cols = w_scale_ptr + expert.to(tl.int64) * (2 * N) + tl.minimum(cols, N - 1)
        acc_gate = acc_gate * row_scale * tl.load(scale_cols)[None, :]
        acc_up = acc_up * row_scale * tl.load(scale_cols + N)[None, :]
    dt = out_ptr.dtype.element_ty
    act = _gate_up_epilogue(acc_gate, acc_up, expert, cols, N, out_ptr, bias_ptr, alpha, limit, BIAS, ACT_OAI, ACT_GELU)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], act.to(dt), mask=cols[None, :] < N)


@triton.jit
def _moe_down_tma_kernel(a_desc, a_ptr, w_desc, weight_ptr, out_ptr, pairs_ptr, block_expert_ptr, num_pairs, num_blocks,
                         N, K, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                         a_scale_ptr=None, w_scale_ptr=None, SCALED: tl.constexpr = False,
                         bias_ptr=None, BIAS: tl.constexpr = False):
    """`_moe_down_kernel` over the sorted rows `_moe_gate_up_tma_kernel` wrote (a [rows, K],
    w_down as [E * N, K], both through descriptors); each row's product goes to its pair's row.
    SCALED: as the gate/up kernel's (e4m3 rows, scales [rows] and [E, N]); `a_ptr` stays the
    16-bit rows, whose dtype the products are rounded to."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n, expert = _sorted_block(num_blocks, N, block_expert_ptr, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_M
    w0 = expert * N + pid_n * BLOCK_N  # a_ptr: what a_desc reads, for its dtype only
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k0])
        b = w_desc.load([w0, k0])
        acc = _moe_dot(a, b.T, acc, IEEE)
    pair = tl.load(pairs_ptr + row0 + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    safe_pair = tl.where(valid, pair, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SCALED:
        acc = (acc * tl.load(a_scale_ptr + row0 + tl.arange(0, BLOCK_M))[:, None]
               * tl.load(w_scale_ptr + expert.to(tl.int64) * N + tl.minimum(cols, N - 1))[None, :])
    routing_weight = tl.load(weight_ptr + safe_pair, mask=valid, other=0.0).to(tl.float32)
    y = _down_epilogue(acc, expert, cols, N, a_ptr, bias_ptr, BIAS) * routing_weight[:, None]
    tl.store(out_ptr + safe_pair[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


def _gate_up_extras(extras: ExpertExtras, stand_in: torch.Tensor) -> dict[str, Any]:
    """The gate/up kernels' arguments for the experts' bias and activation (`stand_in`: a tensor
    passed for a pointer never read)."""
    bias = extras.b_gate_up
    return {"bias_ptr": bias.contiguous() if bias is not None else stand_in, "alpha": float(extras.alpha),
            "limit": float(extras.limit), "BIAS": bias is not None, "ACT_OAI": extras.activation == "swiglu_oai",
            "ACT_GELU": extras.activation == "gelu_tanh"}


def _down_extras(extras: ExpertExtras, stand_in: torch.Tensor) -> dict[str, Any]:
    bias = extras.b_down
    return {"bias_ptr": bias.contiguous() if bias is not None else stand_in, "BIAS": bias is not None}


def _moe_sorted_rows(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                     blocks: PairBlocks, top_k: int, gu_tiling: MoETiling, down_tiling: MoETiling,
                     products: torch.Tensor, w_gate_up_scale: torch.Tensor | None = None,
                     w_down_scale: torch.Tensor | None = None, extras: ExpertExtras = ExpertExtras()) -> None:
    """Both GEMMs by the tensor-descriptor kernels into `products` [pairs, H]: the pairs' rows
    of `hidden` gathered into expert order first (padding rows take token 0's; never stored).
    With the experts' scales (e4m3 experts): e4m3 activations too, each token's hidden state
    and each row's SiLU-and-mul output quantized per row, for e4m3 MMAs (W8A8, as the dense
    FP8 projections run)."""
    num_pairs, h = products.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    block_m = gu_tiling.block_m
    scaled = w_gate_up_scale is not None
    if scaled and hidden.is_cuda:
        # Each sorted row's token quantized where it lands, in one launch: bit for bit the
        # per-token op's CUDA kernel, then the gather below (~6 launches, a layer's W8A8 step).
        x_sorted, x_scale = quantize_fp8_gathered_rows_triton(hidden, blocks.sorted_pairs, num_pairs, top_k)
    else:  # (on CPU the op's own rounding, which the interpreted kernel's reciprocal can miss by a step)
        row_token = torch.where(blocks.sorted_pairs < num_pairs, blocks.sorted_pairs // top_k, 0)
        if scaled:
            xq, x_scale = torch.ops.kiln.quantize_fp8_per_token(hidden)
            x_sorted, x_scale = xq.index_select(0, row_token), x_scale.reshape(-1).index_select(0, row_token)
        else:
            x_sorted, x_scale = hidden.index_select(0, row_token), None
    act = torch.empty((x_sorted.shape[0], inter), dtype=hidden.dtype, device=hidden.device)
    ieee = hidden.dtype == torch.float32 and not scaled  # (e4m3 operands: no float32 precision to keep)
    gu_k, down_k = gu_tiling.block_k, down_tiling.block_k
    x_desc = TensorDescriptor.from_tensor(x_sorted, [block_m, gu_k])
    wgu_desc = TensorDescriptor.from_tensor(w_gate_up.view(num_experts * 2 * inter, h), [gu_tiling.block_n, gu_k])
    _moe_gate_up_tma_kernel[(blocks.num_blocks * triton.cdiv(inter, gu_tiling.block_n),)](
        x_desc, wgu_desc, act, blocks.block_expert, blocks.num_blocks, inter, h, act.stride(0),
        BLOCK_M=block_m, BLOCK_N=gu_tiling.block_n, BLOCK_K=gu_k, GROUP_M=gu_tiling.group_m, IEEE=ieee,
        # (without the scales, tensors never read stand in for their pointers)
        a_scale_ptr=x_scale if scaled else act, w_scale_ptr=w_gate_up_scale if scaled else act, SCALED=scaled,
        **_gate_up_extras(extras, act), num_warps=gu_tiling.num_warps, num_stages=gu_tiling.num_stages, **pdl_launch_args(hidden.device, "moe"),
    )
    act_q, act_scale = torch.ops.kiln.quantize_fp8_per_token(act) if scaled else (act, None)
    act_desc = TensorDescriptor.from_tensor(act_q, [block_m, down_k])
    wd_desc = TensorDescriptor.from_tensor(w_down.view(num_experts * h, inter), [down_tiling.block_n, down_k])
    _moe_down_tma_kernel[(blocks.num_blocks * triton.cdiv(h, down_tiling.block_n),)](
        act_desc, act, wd_desc, weights, products, blocks.sorted_pairs, blocks.block_expert, num_pairs, blocks.num_blocks,
        h, inter, products.stride(0),
        BLOCK_M=block_m, BLOCK_N=down_tiling.block_n, BLOCK_K=down_k, GROUP_M=down_tiling.group_m, IEEE=ieee,
        a_scale_ptr=act_scale.reshape(-1) if scaled else act, w_scale_ptr=w_down_scale if scaled else act,
        SCALED=scaled, **_down_extras(extras, act), num_warps=down_tiling.num_warps, num_stages=down_tiling.num_stages,
        **pdl_launch_args(hidden.device, "moe"),
    )


def _applies(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, fp8: bool) -> bool:
    weight_dtype = FP8_DTYPE if fp8 else hidden.dtype
    return (hidden.dtype in _DTYPES and w_gate_up.dtype == weight_dtype and w_down.dtype == weight_dtype
            and hidden.device == w_gate_up.device == w_down.device
            and hidden.stride(-1) == 1 and w_gate_up.is_contiguous() and w_down.is_contiguous())


def fused_moe_triton(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool,
                     tiling: MoETiling | None = None, per_pair: bool | None = None,
                     tma: bool | None = None, down_tiling: MoETiling | None = None,
                     w_gate_up_scale: torch.Tensor | None = None,
                     w_down_scale: torch.Tensor | None = None,
                     fp8_activations: bool | None = None, row_kernels: bool | None = None) -> torch.Tensor:
    """`kiln::fused_moe` by the grouped-GEMM kernels (`tiling`, `per_pair` and `tma` override
    `choose_tiling`, `pair_per_block` and `uses_tma`, for tests and bench/tune_moe.py;
    `down_tiling`, the down GEMM's tiling alone, whose row blocks stay the gate/up tiling's);
    tensors the kernels cannot take go to the reference. With the scales,
    `kiln::fused_moe_fp8`: e4m3 experts, widened in the pointer kernels' K loops and scaled per
    channel after, or, in prefill-sized steps (FP8_DEQUANT_MIN_ROWS), widened once into 16-bit
    copies for the 16-bit kernels; or, with `fp8_activations` (None: `uses_fp8_activations`),
    W8A8 by the sorted-rows kernels on e4m3 MMAs; `row_kernels` as `moe_experts_triton`'s."""
    check_fused_moe_args(hidden, router_logits, w_gate_up, w_down, top_k)
    routing = route_triton(router_logits, top_k, renormalize, fp32_weights, hidden.dtype)
    return moe_experts_triton(hidden, routing.weights, routing.experts, w_gate_up, w_down, tiling=tiling,
                              per_pair=per_pair, tma=tma, down_tiling=down_tiling, w_gate_up_scale=w_gate_up_scale,
                              w_down_scale=w_down_scale, fp8_activations=fp8_activations, row_kernels=row_kernels)


def moe_experts_triton(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, tiling: MoETiling | None = None,
                       per_pair: bool | None = None, tma: bool | None = None, down_tiling: MoETiling | None = None,
                       w_gate_up_scale: torch.Tensor | None = None, w_down_scale: torch.Tensor | None = None,
                       fp8_activations: bool | None = None, extras: ExpertExtras = ExpertExtras(),
                       row_kernels: bool | None = None) -> torch.Tensor:
    """`kiln::moe_experts` (the routing given: `topk_weights`, `topk_ids` [T, top_k]) by the
    kernels of `fused_moe_triton`, with the same overrides; with the scales, `kiln::moe_experts_fp8`;
    `extras`, the experts' biases and activation (GPT-OSS), applied in the kernels' epilogues.
    `row_kernels` (None: ROW_KERNELS where no tiling is given) runs per-pair steps on the GEMV
    kernels."""
    check_moe_experts_args(hidden, topk_weights, topk_ids, w_gate_up, w_down)
    check_expert_extras(w_gate_up, w_down, extras.b_gate_up, extras.b_down, extras.activation)
    fp8 = w_gate_up_scale is not None
    if fp8:
        check_fused_moe_fp8_args(w_gate_up, w_gate_up_scale, w_down, w_down_scale)
        w_gate_up_scale, w_down_scale = w_gate_up_scale.contiguous(), w_down_scale.contiguous()
    if not _applies(hidden, w_gate_up, w_down, fp8):
        if fp8:
            return moe_experts_fp8_reference(hidden, topk_weights, topk_ids, w_gate_up, w_gate_up_scale, w_down,
                                             w_down_scale, **extras.kwargs())
        return moe_experts_reference(hidden, topk_weights, topk_ids, w_gate_up, w_down, **extras.kwargs())
    # The grouping and the per-pair kernels read the ids as a dense int64 [T, top_k] (a router's
    # may come as int32, or as a view: PhiMoE's are a concatenation).
    topk_ids = topk_ids.to(torch.int64).contiguous()
    top_k = topk_ids.shape[1]
    t, h = hidden.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    num_pairs = t * top_k
    if t == 0:
        return torch.empty_like(hidden)
    if fp8_activations is None:
        fp8_activations = fp8 and tma is not False and per_pair is not True and uses_fp8_activations(
            num_pairs, num_experts, hidden, w_gate_up, w_down)
    if fp8_activations and (not fp8 or per_pair or tma is False):
        raise ValueError("e4m3 activations (W8A8) go with FP8 experts on the sorted-rows kernels only")
    if (fp8 and not fp8_activations and tiling is None and tma is None and per_pair is None
            and dequantizes_fp8_experts(num_pairs, num_experts)):
        w_gate_up = dequantize_experts_triton(w_gate_up, w_gate_up_scale, hidden.dtype)
        w_down = dequantize_experts_triton(w_down, w_down_scale, hidden.dtype)
        fp8, w_gate_up_scale, w_down_scale = False, None, None
    if fp8 and tma and not fp8_activations:
        raise ValueError("the sorted-rows kernels take FP8 experts only with e4m3 activations (fp8_activations)")
    if tiling is None and not fp8 and uses_grouped_mm(num_pairs, num_experts, hidden):
        return moe_experts_grouped_mm(hidden, topk_weights, topk_ids, w_gate_up, w_down, **extras.kwargs())
    if per_pair is None:
        per_pair = pair_per_block(num_pairs, num_experts)
    if fp8_activations:
        per_pair, tma = False, True
    if row_kernels and not per_pair:
        raise ValueError("the MoE row kernels run per-pair steps only (per_pair)")
    row = per_pair and (row_kernels if row_kernels is not None else ROW_KERNELS and tiling is None)
    if tma is None:
        tma = not per_pair and not fp8 and uses_tma(num_pairs, num_experts, hidden, w_gate_up, w_down)
    elem, smem = hidden.element_size(), max_shared_memory(hidden.device)

    def picked(n: int, k: int) -> MoETiling:
        """The chosen tiling of an [n, k] expert GEMM; W8A8's on K tiles of W8A8_BLOCK_K or more
        (a given tiling is taken as it is)."""
        chosen = choose_tiling(num_pairs, num_experts, n, k, elem, smem)
        if fp8_activations:
            chosen = _fit(replace(chosen, block_k=max(chosen.block_k, W8A8_BLOCK_K)), n, k)
        return chosen

    gu_tiling = _fit(tiling, inter, h) if tiling else picked(inter, h)
    down_tiling = _fit(down_tiling or tiling, h, inter) if down_tiling or tiling else picked(h, inter)
    weights = topk_weights.reshape(-1).contiguous()
    products = torch.empty((num_pairs, h), dtype=torch.promote_types(hidden.dtype, weights.dtype),
                           device=hidden.device)
    if tma:
        if per_pair or not _descriptor_ok(w_gate_up, w_down):
            raise ValueError("the sorted-rows kernels take grouped row blocks and 16-byte-aligned weights and rows")
        blocks = group_pairs_for_step(topk_ids, num_experts, gu_tiling.block_m)
        _moe_sorted_rows(hidden, w_gate_up, w_down, weights, blocks, top_k, gu_tiling, down_tiling, products,
                         w_gate_up_scale, w_down_scale, extras)
    elif row:
        _moe_row_kernels(hidden, w_gate_up, w_down, weights, topk_ids, top_k, products, w_gate_up_scale,
                         w_down_scale, extras)
    else:
        _moe_pointer_kernels(hidden, w_gate_up, w_down, weights, topk_ids, top_k, gu_tiling, down_tiling,
                             per_pair, products, w_gate_up_scale, w_down_scale, extras)
    return products.view(t, top_k, h).sum(dim=1).to(hidden.dtype)


def _moe_pointer_kernels(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                         experts: torch.Tensor, top_k: int, gu_tiling: MoETiling, down_tiling: MoETiling,
                         per_pair: bool, products: torch.Tensor, w_gate_up_scale: torch.Tensor | None,
                         w_down_scale: torch.Tensor | None, extras: ExpertExtras = ExpertExtras()) -> None:
    """Both GEMMs by the pointer kernels into `products` [pairs, H] (FP8 experts with the scales)."""
    num_pairs, h = products.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    fp8 = w_gate_up_scale is not None
    if per_pair:
        num_blocks, sorted_pairs, block_expert = num_pairs, experts, experts  # pairs unused
    else:
        blocks = group_pairs_for_step(experts, num_experts, gu_tiling.block_m)
        num_blocks, sorted_pairs, block_expert = blocks.num_blocks, blocks.sorted_pairs, blocks.block_expert
    ieee = hidden.dtype == torch.float32
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    _moe_gate_up_kernel[(num_blocks * triton.cdiv(inter, gu_tiling.block_n),)](
        hidden, w_gate_up, act, sorted_pairs, block_expert, num_pairs, num_blocks, inter, h,
        hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=gu_tiling.block_m, BLOCK_N=gu_tiling.block_n, BLOCK_K=gu_tiling.block_k,
        GROUP_M=gu_tiling.group_m,
        EVEN_K=h % gu_tiling.block_k == 0, IEEE=ieee, PAIR_PER_BLOCK=per_pair,
        w_scale_ptr=w_gate_up_scale if fp8 else w_gate_up, W_FP8=fp8,  # (never read without W_FP8)
        **_gate_up_extras(extras, act), num_warps=gu_tiling.num_warps, num_stages=gu_tiling.num_stages, **pdl_launch_args(hidden.device, "moe"),
    )
    _moe_down_kernel[(num_blocks * triton.cdiv(h, down_tiling.block_n),)](
        act, w_down, weights, products, sorted_pairs, block_expert, num_pairs, num_blocks, h, inter,
        act.stride(0), w_down.stride(0), w_down.stride(1), products.stride(0),
        BLOCK_M=gu_tiling.block_m, BLOCK_N=down_tiling.block_n, BLOCK_K=down_tiling.block_k,
        GROUP_M=down_tiling.group_m,
        EVEN_K=inter % down_tiling.block_k == 0, IEEE=ieee, PAIR_PER_BLOCK=per_pair,
        w_scale_ptr=w_down_scale if fp8 else w_down, W_FP8=fp8,
        **_down_extras(extras, act), num_warps=down_tiling.num_warps, num_stages=down_tiling.num_stages, **pdl_launch_args(hidden.device, "moe"),
    )


def _moe_row_kernels(hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
                     experts: torch.Tensor, top_k: int, products: torch.Tensor, w_gate_up_scale: torch.Tensor | None,
                     w_down_scale: torch.Tensor | None, extras: ExpertExtras = ExpertExtras()) -> None:
    """Both GEMMs of a per-pair step by the GEMV kernels (`ROW_KERNELS`) into `products` [pairs, H]."""
    num_pairs, h = products.shape
    inter = w_gate_up.shape[1] // 2
    fp8 = w_gate_up_scale is not None
    elem = w_gate_up.element_size()
    experts = experts.reshape(-1)
    act = torch.empty((num_pairs, inter), dtype=hidden.dtype, device=hidden.device)
    gu = row_tiling(num_pairs, inter, h, elem, halves=2)
    _moe_gate_up_row_kernel[(num_pairs, triton.cdiv(inter, gu.block_n))](
        hidden, w_gate_up, act, experts, inter, h, hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        act.stride(0), w_gate_up_scale if fp8 else w_gate_up,  # (never read without W_FP8)
        TOP_K=top_k, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, EVEN_K=h % gu.block_k == 0, W_FP8=fp8,
        **_gate_up_extras(extras, act), num_warps=gu.num_warps, num_stages=gu.num_stages,
        **pdl_launch_args(hidden.device, "moe"),
    )
    down = row_tiling(num_pairs, h, inter, elem)
    _moe_down_row_kernel[(num_pairs, triton.cdiv(h, down.block_n))](
        act, w_down, weights, products, experts, h, inter, act.stride(0), w_down.stride(0), w_down.stride(1),
        products.stride(0), w_down_scale if fp8 else w_down, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        EVEN_K=inter % down.block_k == 0, W_FP8=fp8, **_down_extras(extras, act), num_warps=down.num_warps,
        num_stages=down.num_stages, **pdl_launch_args(hidden.device, "moe"),
    )


@triton.jit
def _dequantize_rows_kernel(q_ptr, scale_ptr, out_ptr, cols, BLOCK: tl.constexpr):
    """out[row, :] = q[row, :] (e4m3) x scale[row], in out's dtype; one program per row and block."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    q = tl.load(q_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offs, (q * tl.load(scale_ptr + row)).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_experts_triton(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] e4m3 experts times their [E, N] channel scales, in `dtype` (as
    `kiln.kernels.moe.dequantize_experts`, which rounds the same float32 products)."""
    if w.dim() != 3 or scale.shape != w.shape[:2]:
        raise ValueError(f"dequantize_experts: weights {tuple(w.shape)} need [E, N] scales, got {tuple(scale.shape)}")
    w, scale = w.contiguous(), scale.contiguous().float()
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    rows, cols = w.shape[0] * w.shape[1], w.shape[2]
    if out.numel():
        block = min(4096, triton.next_power_of_2(cols))
        _dequantize_rows_kernel[(rows, triton.cdiv(cols, block))](w, scale, out, cols, BLOCK=block, num_warps=4)
    return out


@fused_moe_op.register_kernel("cuda")
def _fused_moe_cuda(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool) -> torch.Tensor:
    return fused_moe_triton(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, fp32_weights)


@fused_moe_fp8_op.register_kernel("cuda")
def _fused_moe_fp8_cuda(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                        w_gate_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor, top_k: int,
                        renormalize: bool, fp32_weights: bool) -> torch.Tensor:
    return fused_moe_triton(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, fp32_weights,
                            w_gate_up_scale=w_gate_up_scale, w_down_scale=w_down_scale)


@moe_experts_op.register_kernel("cuda")
def _moe_experts_cuda(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      w_gate_up: torch.Tensor, w_down: torch.Tensor, **extras: Any) -> torch.Tensor:
    return moe_experts_triton(hidden, topk_weights, topk_ids, w_gate_up, w_down, extras=ExpertExtras(**extras))


@moe_experts_fp8_op.register_kernel("cuda")
def _moe_experts_fp8_cuda(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          w_gate_up: torch.Tensor, w_gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                          w_down_scale: torch.Tensor, **extras: Any) -> torch.Tensor:
    return moe_experts_triton(hidden, topk_weights, topk_ids, w_gate_up, w_down, w_gate_up_scale=w_gate_up_scale,
                              w_down_scale=w_down_scale, extras=ExpertExtras(**extras))
