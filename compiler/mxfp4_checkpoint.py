"""MXFP4 checkpoints (OpenAI's GPT-OSS releases): how their experts load.

`quantization_config.quant_method == "mxfp4"` stores each MoE expert matrix as two tensors
beside where the 16-bit one would be (`X` = `model.layers.N.mlp.experts.gate_up_proj` or
`.down_proj`):

  X_blocks  uint8 [E, rows, K / 32, 16]  two FP4 (e2m1) values a byte, the low nibble first,
                                         along the K (input) dimension of each output row
  X_scales  uint8 [E, rows, K / 32]      one shared power of two (e8m0: 2^(s - 127)) for
                                         each block of 32 values

and everything else (attention, router, biases, embeddings) in 16 bits. The model's tensor
is the transpose, [E, K, rows] (GPT-OSS keeps its experts as [in, out]). Kiln dequantizes
the experts as they load, to the compute dtype (or, with `quantization="fp8"`, to e4m3 by
the load-time quantizer after that): every FP4 value times its scale is exact in bfloat16.
Kiln has no FP4 GEMM; running the experts in FP4 is not built.
"""

from __future__ import annotations

import torch

MXFP4_METHOD = "mxfp4"
BLOCK = 32  # values per shared scale
# e2m1: sign, two exponent bits, one mantissa bit; index = the nibble.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS_SUFFIX, _SCALES_SUFFIX = "_blocks", "_scales"


class MXFP4CheckpointError(ValueError):
    """An MXFP4 tensor pair Kiln cannot read; the message names it."""


def mxfp4_source_names(name: str) -> list[str]:
    """The checkpoint's two tensors for model tensor `name` (blocks, scales)."""
    return [name + _BLOCKS_SUFFIX, name + _SCALES_SUFFIX]


def is_mxfp4_source(sources: list[str]) -> bool:
    return len(sources) == 2 and sources[0].endswith(_BLOCKS_SUFFIX) and sources[1].endswith(_SCALES_SUFFIX)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, K / 32, 16] uint8 blocks and [..., rows, K / 32] uint8 scales -> [..., rows, K].

    One leading index (an expert) at a time, so the nibble indices stay one expert's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MXFP4CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise MXFP4CheckpointError(f"MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of shape "
                                   f"{tuple(scales.shape)} (expected [..., K/32, 16] and [..., K/32])")
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    lead = blocks.shape[0] if blocks.dim() > 3 else 1
    flat_blocks = blocks.reshape(lead, -1, BLOCK // 2)
    flat_scales = scales.reshape(lead, -1, 1).to(torch.int32) - 127
    out = torch.empty((lead, flat_blocks.shape[1], BLOCK), dtype=dtype, device=blocks.device)
    for i in range(lead):
        packed = flat_blocks[i]
        out[i, :, 0::2] = lut[(packed & 0x0F).long()]
        out[i, :, 1::2] = lut[(packed >> 4).long()]
        torch.ldexp(out[i], flat_scales[i], out=out[i])
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def expert_tensor_from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model's [E, K, rows] expert tensor from the checkpoint's [E, rows, ...] pair."""
    return dequantize_mxfp4(blocks, scales, dtype).transpose(-1, -2).contiguous()


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, K] -> (blocks, scales) as an MXFP4 checkpoint stores them: each block of 32
    values shares the power of two that brings its largest magnitude to at most 6 (e2m1's
    largest), each value rounded to the nearest e2m1 value. For writing test checkpoints."""
    if weight.shape[-1] % BLOCK:
        raise MXFP4CheckpointError(f"MXFP4 needs K a multiple of {BLOCK}, got {weight.shape[-1]}")
    w = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    amax = w.abs().amax(dim=-1, keepdim=True).clamp_min(2.0 ** -126)
    exponent = (torch.ceil(torch.log2(amax / 6.0))).clamp(-127, 127)
    scaled = w / torch.exp2(exponent)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    nibbles = (nearest + 8 * (scaled < 0).long()).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return blocks, scales
