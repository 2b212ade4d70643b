"""Pre-quantized FP8 checkpoints: which ones Kiln reads, and how a weight and its scale load.

Two Hugging Face forms, as they are laid out on the Hub:

- `quantization_config.quant_method == "fp8"` (transformers' FineGrainedFP8, DeepSeek-V3 style):
  `X.weight` float8_e4m3fn and `X.weight_scale_inv` float32 with one value per
  `weight_block_size` block ([ceil(N/bn), ceil(K/bk)]; despite its name it multiplies:
  W = weight * scale). A single value, or one per row, is taken as it is.
- `quant_method == "compressed-tensors"` with float 8-bit weights (llm-compressor's FP8 and
  FP8_DYNAMIC schemes): `X.weight` float8_e4m3fn and `X.weight_scale` float32, [1] for the
  `tensor` strategy, [N, 1] for `channel`. A static `X.input_scale` is not used: Kiln
  quantizes activations per token at run time.

Per-tensor and per-channel weights load as they are: the e4m3 values, and the scale as one
value per output channel beside them (`<name>_scale`, kiln.passes.weight_transforms), which
the `quantize_fp8` pass's transform keeps. Block-wise weights are dequantized at load and
requantized per channel by that transform (Kiln's FP8 GEMM takes per-channel weight scales).
Tensors the graph does not take in FP8 (the LM head, routers, MoE experts) are dequantized
to the compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.compiler.mxfp4_checkpoint import MXFP4_METHOD
from kiln.passes.quantize_fp8 import quantization_config

FP8_CHECKPOINT_METHODS = ("fp8", "compressed-tensors")  # and MXFP4, read by kiln.compiler.mxfp4_checkpoint
_SCALE_SUFFIXES = ("_scale", "_scale_inv")  # appended to "....weight"


class FP8CheckpointError(ValueError):
    """A quantized checkpoint Kiln cannot read; the message names the field."""


def checkpoint_quantization(config: Any) -> str | None:
    """"fp8" for a config whose `quantization_config` is an FP8 form Kiln reads, None without
    one; FP8CheckpointError for any other quantization (naming it)."""
    qc = quantization_config(config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return "fp8"
    if method == MXFP4_METHOD:
        return None  # dequantized as it loads (kiln.compiler.mxfp4_checkpoint): no FP8 implied
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not groups:
            raise FP8CheckpointError("compressed-tensors quantization_config has no config_groups")
        for name, group in groups.items():
            weights = (group or {}).get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise FP8CheckpointError(
                    f"compressed-tensors group {name!r} quantizes weights as {weights.get('type')!r} "
                    f"{weights.get('num_bits')}-bit; Kiln reads float 8-bit (FP8) weights only")
            if weights.get("strategy") not in ("tensor", "channel", None):
                raise FP8CheckpointError(f"compressed-tensors group {name!r} has weight strategy "
                                         f"{weights.get('strategy')!r}; Kiln reads 'tensor' and 'channel'")
        return "fp8"
    raise FP8CheckpointError(f"quantization_config quant_method {method!r} is not supported; Kiln reads FP8 "
                             f"checkpoints ({', '.join(FP8_CHECKPOINT_METHODS)} with float8 weights)")


def scale_keys(weight_key: str) -> tuple[str, ...]:
    """Checkpoint names a weight's scale may have."""
    return tuple(weight_key + suffix for suffix in _SCALE_SUFFIXES)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def row_scale(scale: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The scale as [1] (per tensor) or [rows] (per channel) float32, or None (block-wise)."""
    flat = scale.float().reshape(-1)
    if flat.numel() == 1 or (flat.numel() == rows and (scale.dim() <= 1 or scale.shape[-1] == 1)):
        return flat
    return None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight * scale for per-tensor, per-channel and block-wise scales, in `dtype`."""
    w = weight.float()
    per_row = row_scale(scale, w.shape[0])
    if per_row is not None:
        return (w * per_row.reshape(-1, *([1] * (w.dim() - 1)))).to(dtype)
    if scale.dim() != 2 or w.dim() != 2:
        raise FP8CheckpointError(f"FP8 weight of shape {tuple(weight.shape)} has a scale of shape "
                                 f"{tuple(scale.shape)} that is neither per tensor, per channel nor per 2-D block")
    n, k = w.shape
    bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
    full = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w * full).to(dtype)
