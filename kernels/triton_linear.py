"""Triton kernel for `kiln::linear` (registered for CUDA): a GEMV for decode-sized inputs.

At batch 1-16 a projection reads its whole weight to produce a few rows, so its time is
the weight's bytes over the achieved bandwidth. On the H200 (Llama-3-8B shapes) cuBLAS
launches too few CTAs for the QKV and O projections (96 / 64 for 132 SMs) and uses split-K
plus a separate reduce kernel for O and down; these kernels give each program BLOCK_N output
columns and the whole K loop (fp32 accumulation, no split-K, one launch). Timed inside CUDA
graphs on the H200 (bf16, M = 1..16): qkv 4-9% and o 7-14% faster than cuBLAS, down and the
LM head 0-5%, gate/up 2.5% at M = 1 and within 2% either way above (so gate/up-sized
weights keep cuBLAS at 2-16 rows). Two kernels: M == 1
multiplies and sums on the CUDA cores (no tensor-core tile to fill); 2..16 rows use `tl.dot`
on a BLOCK_M = 16 tile, the rows past M masked to zero.

Every decision (kernel, config, fallback to F.linear / cuBLAS) comes from shapes, dtypes
and layout only: nothing is read from the GPU and nothing is tuned at run time, so a
launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.linear import check_linear_args
from kiln.kernels.linear import linear as linear_op
from kiln.kernels.triton_common import GEMV_EARLY_TILE, max_shared_memory, pdl_launch_args, wait_for_previous_kernel

# Above this many rows the weight is reused enough for cuBLAS's GEMM tiles to win.
GEMV_MAX_ROWS = 16
# tl.dot's smallest row tile; rows M..15 of it are masked.
DOT_BLOCK_M = 16
# The smallest K tile a table's tile is halved to when it does not divide K (the tables'
# smallest tile before the long-K rows was 256).
MIN_HALVED_BLOCK_K = 256
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # One row through the tl.dot kernel too (its 16-row tile, 15 rows masked) instead of the
    # CUDA-core row kernel: at eight rows the FP8 dot kernel streamed gate/up faster than the
    # row kernel did at one (32.6 against 34.3 us, bench/RESULTS.md I4). Swept by
    # bench/tune_gemv.py at one row: FP8 gate/up takes it (kiln.kernels.triton_fp8).
    dot: bool = False
    # The tl.dot kernel's row tile (rows past M masked). 16 runs mma.sync with the weight tile
    # converted to 16 bits; 64 fills a Hopper warpgroup's MMA (wgmma), which takes e4m3
    # operands as they are (no conversion) and reads both tiles from shared memory, summing in
    # the tensor core's FP8 accumulator (fast accumulation). The FP8 table's 2-16-row rows take
    # it (bench/RESULTS.md S1); the bf16 tables keep 16.
    block_m: int = DOT_BLOCK_M
    # K split over this many programs per column tile, the last to finish summing the
    # partials (kiln.kernels.triton_common.split_k_sum): more programs in flight for narrow
    # outputs. The FP8 GEMVs take it (bf16's run unsplit); swept by bench/tune_gemv.py. No
    # table row uses it: on the H200 it was slower than the 64-row tile unsplit at every
    # Llama-3-8B projection and row count swept (bench/RESULTS.md S1-S2).
    split_k: int = 1
    # FP8 only (kiln.kernels.triton_fp8's dot kernel, SWAP_AB), at 1-16 rows: the weight tile
    # as the MMA's M side (block_n of 64 or 128 output columns, a Hopper warpgroup's M) and
    # the rows as its N side (16, rows past M masked), y^T = W x^T, instead of 64 rows of
    # which 2-16 are real. The FP8 table's 2-16-row rows take it since bench/RESULTS.md X2.
    swap_ab: bool = False


# Heuristic tables: (largest N, largest K, config); the first row that fits wins. Seeded with
# the best configs of the H200 sweeps at the Llama-3-8B shapes (bench/tune_gemv.py, bf16; the
# dot table was swept at M = 8 and serves 2..16). One row (2026-12-01 sweep, weights past L2):
# narrow column tiles with long K tiles stream fastest at every projection but QKV (o 10.7
# against 11.7 us with the earlier 16 x 512 tiles, down 29.6 against 31.5, gate/up 54.8
# against 55.8, the LM head 228.6 against 231.9); QKV keeps 16 x 512 (14.7 us, no tiling
# faster). Several rows: narrow outputs get large K tiles (few programs, each must keep many
# bytes in flight); wide ones do better with smaller tiles, more programs resident per SM.
ROW_TABLE: tuple[tuple[float, float, GemvConfig | None], ...] = (
    (4096, 4096, GemvConfig(4, 1024, 4, 4)),          # o_proj 4096 x 4096
    (4096, math.inf, GemvConfig(8, 1024, 4, 4)),      # down 4096 x 14336
    (8192, math.inf, GemvConfig(16, 512, 8, 4)),      # qkv 6144 x 4096
    (math.inf, math.inf, GemvConfig(4, 2048, 8, 4)),  # gate_up 28672 x 4096, LM head
)
# None: cuBLAS. At 2-16 rows cuBLAS's GEMM already streams the gate/up weight at ~4.1 TB/s
# (this GEMV was 0-2% slower there); the LM head, wider still, gains ~4%.
DOT_TABLE: tuple[tuple[float, float, GemvConfig | None], ...] = (
    (4096, math.inf, GemvConfig(32, 512, 4, 4)),      # o, down: 128 programs for 132 SMs
    (8192, math.inf, GemvConfig(64, 256, 4, 4)),      # qkv: 96 programs
    (65536, math.inf, None),                          # gate_up 28672 x 4096
    (math.inf, math.inf, GemvConfig(64, 128, 4, 3)),  # LM head
)


def choose_config(n: int, k: int, m: int, element_size: int = 2, shared_memory: int = 0) -> GemvConfig | None:
    """The GEMV config for an [m, k] x [n, k]^T product, or None: use cuBLAS. `shared_memory`:
    bytes a program may use on the device (0: no limit; the tables fit an H100/H200)."""
    if not (1 <= m <= GEMV_MAX_ROWS and n >= 1 and k >= 1):
        return None
    table = ROW_TABLE if m == 1 else DOT_TABLE
    config = next(c for max_n, max_k, c in table if n <= max_n and k <= max_k)
    if config is None:
        return None
    if element_size > 2:
        # The tables are for 2-byte weights; keep each tile's bytes: float32 tiles at the
        # bf16 BLOCK_K overflowed shared memory on the H200 (288 KiB for 227 KiB).
        config = dataclasses.replace(config, block_k=max(16, config.block_k * 2 // element_size))
    if m > 1 or config.dot:
        config = fit_shared_memory(config, element_size, shared_memory)
    return fit_block_k(config, k)


def fit_shared_memory(config: GemvConfig, element_size: int, shared_memory: int,
                      early_tile: bool = False) -> GemvConfig:
    """The 2-16-row kernel's config with its staged tiles within `shared_memory` bytes (0: no
    limit). At a 16-row tile Triton stages num_stages - 1 buffers of the [16, BLOCK_K] row
    tile and the [BLOCK_N, BLOCK_K] weight tile (the sizes its out-of-resources errors
    report on the H200); the tables' (32, 512, 4 stages) needs 144 KB, more than an L4's
    99 KB. At a 64-row tile (warpgroup MMA, both operands in shared memory) it keeps
    num_stages buffers, and one more for a tile loaded before the loop (`early_tile`, the
    FP8 kernel's): the sizes of sm_90 compiles. Fewer stages first, then shorter K tiles.
    The one-row kernel stages nothing."""
    def staged(c: GemvConfig) -> int:
        buffers = c.num_stages + int(early_tile) if c.block_m >= 64 or c.swap_ab else c.num_stages - 1
        return buffers * (c.block_m + c.block_n) * c.block_k * element_size

    while shared_memory and staged(config) > shared_memory and config.num_stages > 2:
        config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    while shared_memory and staged(config) > shared_memory and config.block_k > 32:
        config = dataclasses.replace(config, block_k=config.block_k // 2)
    return config


def fit_block_k(config: GemvConfig, k: int, floor: int = MIN_HALVED_BLOCK_K) -> GemvConfig | None:
    """`config` with a K tile that divides `k` (each split's share of it, with
    `split_k`), or None. The K loop has no mask (so every
    weight load is a full-width vector load): a K the tile does not divide (5,120, 11,008)
    takes the largest halving of it that does, down to `floor` (never below the tile itself
    when that is smaller); below that, None (cuBLAS)."""
    block_k = config.block_k
    split = config.split_k
    while k % (block_k * split) and block_k // 2 >= min(floor, config.block_k):
        block_k //= 2
    if k % (block_k * split):
        return None
    return config if block_k == config.block_k else dataclasses.replace(config, block_k=block_k)


@triton.jit
def _gemv_row_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                     EARLY_TILE: tl.constexpr = False):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns past N (last program) re-read row N-1 instead of masking: the loop's loads stay
    # unpredicated, and the extra results are never stored.
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K
    first = tl.arange(0, BLOCK_K)
    if EARLY_TILE:  # GEMV_EARLY_TILE: the first weight tile before the wait
        w_first = tl.load(w_rows + first[None, :])
    wait_for_previous_kernel(PDL)
    # Reduce over K once, after the loop: the loop body is independent multiply-adds.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start = 0
    if EARLY_TILE:
        acc += w_first.to(tl.float32) * tl.load(x_ptr + first).to(tl.float32)[None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])
        x = tl.load(x_ptr + ks)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr = False):
    # No early weight tile here (GEMV_EARLY_TILE): the tables' 2-byte tiles held in registers
    # across the wait (64 a thread) made bf16 decode at batch 8 5% slower on the H200 (R3).
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * K  # as in the row kernel
    wait_for_previous_kernel(PDL)
    x_rows = x_ptr + rows[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :])
        x = tl.load(x_rows + ks[None, :], mask=rows[:, None] < M, other=0.0)
        # ieee: fp32 inputs must not drop to TF32 (F.linear does not by default).
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, m: int,
                  config: GemvConfig | None) -> bool:
    return (config is not None and 1 <= m <= GEMV_MAX_ROWS and weight.dtype in _DTYPES
            and weight.is_contiguous() and weight.shape[1] % config.block_k == 0
            and x.device == weight.device and (bias is None or bias.is_contiguous()))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by a Triton GEMV when the rows are few (`config` overrides
    the table, for tests); otherwise, or when the kernel cannot take the tensors, F.linear."""
    check_linear_args(x, weight, bias)
    n, k = weight.shape
    m = x.numel() // k if k else 0
    config = config or choose_config(n, k, m, weight.element_size(), max_shared_memory(x.device))
    if not _gemv_applies(x, weight, bias, m, config):
        return F.linear(x, weight, bias)
    x2 = x.reshape(m, k)  # a view whenever the leading dimensions allow one
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    b = bias if bias is not None else y  # never read without HAS_BIAS
    grid = (triton.cdiv(n, config.block_n),)
    if m == 1 and not config.dot:
        _gemv_row_kernel[grid](x2, weight, b, y, n, k, HAS_BIAS=bias is not None,
                               BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                               num_warps=config.num_warps, num_stages=config.num_stages,
                               EARLY_TILE=GEMV_EARLY_TILE, **pdl_launch_args(x.device, "linear"))
    else:
        _gemv_dot_kernel[grid](x2, weight, b, y, m, n, k, x2.stride(0), HAS_BIAS=bias is not None,
                               BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                               num_warps=config.num_warps, num_stages=config.num_stages,
                               **pdl_launch_args(x.device, "linear"))
    return y.view(*x.shape[:-1], n)


@linear_op.register_kernel("cuda")
def _linear_cuda(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return linear_triton(x, weight, bias)
