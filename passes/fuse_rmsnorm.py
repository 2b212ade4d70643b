"""`fuse_rmsnorm`: RMSNorm, and the residual add in front of it, as one `kiln::` op.

Before (per decoder layer, bf16; the casts vanish in float32 graphs):
    s = add(x, residual); h = to(s, f32); h = mul(h, rsqrt(add(mean(pow(h, 2), [-1]), eps)))
    out = mul(weight, to(h, bf16))          # and `s` feeds the next residual add
After:
    out, s = kiln::add_rms_norm(x, residual, weight, eps)

Gemma's, Qwen3-Next's and Qwen3.5's norm, `(h * (1.0 + weight.float())).type_as(x)` (the
weight an offset from 1, joined in float32, one rounding), becomes `kiln::add_offset_rms_norm`
/ `kiln::offset_rms_norm` with offset 1.

GPT-OSS's, OLMo 2/3's, Helium's, FlexOlmo's, AFMoE's and Nemotron-H's norm, `(weight * h).to(x.dtype)`
(the weight joined in float32, one rounding), is the same op with offset 0
(`add_rms_norm_fp32_weight` / `rms_norm_fp32_weight`). In float32 graphs, where no cast is
left, these forms are the Llama form and match its patterns first. Gemma 4's writes the
reciprocal root as `torch.pow(mean + eps, -0.5)` and the weight after the norm,
`(h * weight.float()).type_as(x)`: the same op (`add_rms_norm_pow` / `rms_norm_pow`).

Qwen3-Next's and Qwen3.5's gated norm after each gated DeltaNet layer, once its norm is
`kiln::rms_norm`: `(rms_norm(x) * silu(gate.float())).to(x.dtype)` becomes
`kiln::gated_rms_norm(x, gate, weight, eps)` (the patterns apply in order).

A norm without an add in front (the first layer's input norm, Qwen3's per-head q/k norm
when `fuse_rope` did not take it) becomes `kiln::rms_norm(x, weight, eps)`. The residual
form is tried first so it claims its adds. Runs on CUDA graphs by default; see
`kiln.passes.fuse_common` for the CPU policy.
"""

from __future__ import annotations

import torch

from kiln.passes.fuse_common import CustomOpFusionPass, hf_offset_rms_norm, hf_rms_norm, hf_rms_norm_fp32_weight
from kiln.passes.pattern import Pattern, PatternMatch

_X = torch.randn(1, 4, 32)  # [1, tokens, hidden], the rank of the graph's hidden states
_W = torch.randn(32)


def add_rms_norm_pattern(x, residual, weight, eps):
    summed = x + residual
    return hf_rms_norm(summed, weight, eps), summed


def add_rms_norm_replacement(x, residual, weight, eps):
    out, summed = torch.ops.kiln.add_rms_norm(x, residual, weight, eps)
    return out, summed


def rms_norm_pattern(x, weight, eps):
    return hf_rms_norm(x, weight, eps)


def rms_norm_replacement(x, weight, eps):
    return torch.ops.kiln.rms_norm(x, weight, eps)


def add_offset_rms_norm_pattern(x, residual, weight, eps):
    summed = x + residual
    return hf_offset_rms_norm(summed, weight, eps), summed


def add_offset_rms_norm_replacement(x, residual, weight, eps):
    out, summed = torch.ops.kiln.add_offset_rms_norm(x, residual, weight, eps, 1.0)
    return out, summed


def offset_rms_norm_pattern(x, weight, eps):
    return hf_offset_rms_norm(x, weight, eps)


def offset_rms_norm_replacement(x, weight, eps):
    return torch.ops.kiln.offset_rms_norm(x, weight, eps, 1.0)


def add_rms_norm_fp32_weight_pattern(x, residual, weight, eps):
    summed = x + residual
    return hf_rms_norm_fp32_weight(summed, weight, eps), summed


def add_rms_norm_fp32_weight_replacement(x, residual, weight, eps):
    out, summed = torch.ops.kiln.add_offset_rms_norm(x, residual, weight, eps, 0.0)
    return out, summed


def rms_norm_fp32_weight_replacement(x, weight, eps):
    return torch.ops.kiln.offset_rms_norm(x, weight, eps, 0.0)


def hf_rms_norm_pow(x, weight, eps):
    """Gemma 4's RMSNorm as its modeling code writes it (`torch.pow` for the reciprocal root,
    "to address compiler differences between Torch and JAX"; the weight joined in float32)."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (h * weight.float()).type_as(x)


def add_rms_norm_pow_pattern(x, residual, weight, eps):
    summed = x + residual
    return hf_rms_norm_pow(summed, weight, eps), summed


def gated_rms_norm_pattern(x, gate, weight, eps):
    return (torch.ops.kiln.rms_norm(x, weight, eps) * torch.nn.functional.silu(gate.to(torch.float32))).to(x.dtype)


def gated_rms_norm_replacement(x, gate, weight, eps):
    return torch.ops.kiln.gated_rms_norm(x, gate, weight, eps)


def weight_over_last_dim(match: PatternMatch) -> bool:
    """The ops scale the last dimension by a vector: a weight of another shape (Falcon-H1's
    grouped norm multiplies [groups, size] into [..., groups, size]) is left unfused."""
    weight, x = match.input_val("weight"), match.input_val("x")
    return (not isinstance(weight, torch.Tensor) or not isinstance(x, torch.Tensor)
            or (weight.dim() == 1 and weight.shape[0] == x.shape[-1]))


ADD_RMS_NORM = Pattern("add_rms_norm", add_rms_norm_pattern, add_rms_norm_replacement, (_X, _X, _W, 1e-6),
                       where=weight_over_last_dim)
RMS_NORM = Pattern("rms_norm", rms_norm_pattern, rms_norm_replacement, (_X, _W, 1e-6), where=weight_over_last_dim)
ADD_OFFSET_RMS_NORM = Pattern("add_offset_rms_norm", add_offset_rms_norm_pattern, add_offset_rms_norm_replacement,
                              (_X, _X, _W, 1e-6), where=weight_over_last_dim)
OFFSET_RMS_NORM = Pattern("offset_rms_norm", offset_rms_norm_pattern, offset_rms_norm_replacement, (_X, _W, 1e-6),
                          where=weight_over_last_dim)
GATED_RMS_NORM = Pattern("gated_rms_norm", gated_rms_norm_pattern, gated_rms_norm_replacement, (_X, _X, _W, 1e-6),
                         where=weight_over_last_dim)
ADD_FP32_WEIGHT = Pattern("add_rms_norm_fp32_weight", add_rms_norm_fp32_weight_pattern,
                          add_rms_norm_fp32_weight_replacement, (_X, _X, _W, 1e-6), where=weight_over_last_dim)
FP32_WEIGHT = Pattern("rms_norm_fp32_weight", hf_rms_norm_fp32_weight, rms_norm_fp32_weight_replacement,
                      (_X, _W, 1e-6), where=weight_over_last_dim)
ADD_POW = Pattern("add_rms_norm_pow", add_rms_norm_pow_pattern, add_rms_norm_fp32_weight_replacement,
                  (_X, _X, _W, 1e-6), where=weight_over_last_dim)
POW = Pattern("rms_norm_pow", hf_rms_norm_pow, rms_norm_fp32_weight_replacement, (_X, _W, 1e-6),
              where=weight_over_last_dim)


class FuseRMSNormPass(CustomOpFusionPass):
    name = "fuse_rmsnorm"
    patterns = (ADD_RMS_NORM, RMS_NORM, ADD_OFFSET_RMS_NORM, OFFSET_RMS_NORM, ADD_FP32_WEIGHT, FP32_WEIGHT,
                ADD_POW, POW, GATED_RMS_NORM)
