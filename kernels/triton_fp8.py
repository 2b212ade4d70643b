"""Triton kernel for `kiln::quantize_fp8_per_token` (registered for CUDA).

The plain-torch reference is five launches (abs, amax, divide, clamp, cast) and reads the
activation twice from memory at full precision; this kernel is one launch, one program per
token row: a first loop over K finds max|x|, a second writes x / scale as e4m3 (the row is
read twice, the second time mostly from L2). `kiln::fp8_linear` itself stays on
`torch._scaled_mm` (cuBLASLt's FP8 GEMM with row-wise scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE
from kiln.kernels.fp8 import quantize_fp8_per_token as quantize_op


@triton.jit
def _quantize_rows_kernel(x_ptr, xq_ptr, scale_ptr, K, stride_x, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_C, MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        # div_rn: IEEE division, as the reference divides (the default is an approximation).
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX_C), FP8_MAX_C)
        tl.store(xq_ptr + row * K + ks, q.to(xq_ptr.dtype.element_ty), mask=ks < K)


def quantize_fp8_per_token_triton(x: torch.Tensor, block_k: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() < 1:
        raise ValueError("quantize_fp8_per_token: x must have at least one dimension")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(block_k, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x2, xq, scale, k, x2.stride(0), FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
                                    BLOCK_K=block, num_warps=4)
    return xq.view(x.shape), scale.view(*x.shape[:-1], 1)


@quantize_op.register_kernel("cuda")
def _quantize_fp8_per_token_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_token_triton(x)
