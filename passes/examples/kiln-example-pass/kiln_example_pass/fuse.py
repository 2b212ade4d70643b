"""The pass: find `gelu(gate, approximate="tanh") * up`, call the fused op instead.

A pattern is two plain functions of the same inputs plus example inputs to trace them with
(`kiln.passes.pattern`). Kiln traces both to the ATen graph its captured models use and
rewrites every match. The pattern is written the way the model's code computes it:
transformers' LlamaMLP does `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, so the
activation is the left operand of the multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.passes.pattern import Pattern, PatternMatch, PatternPass

import kiln_example_pass.ops  # noqa: F401  (registers torch.ops.kiln_example.gelu_tanh_and_mul)


def gelu_tanh_and_mul_unfused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_fused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.ops.kiln_example.gelu_tanh_and_mul(gate, up)


def same_shape_and_dtype(match: PatternMatch) -> bool:
    """The fused op takes equal shapes only; a broadcasting multiply stays unfused."""
    gate, up = match.input_val("gate"), match.input_val("up")
    if gate is None or up is None:
        return False
    return gate.shape == up.shape and gate.dtype == up.dtype


GELU_TANH_AND_MUL = Pattern(
    "gelu_tanh_and_mul",
    pattern=gelu_tanh_and_mul_unfused,
    replacement=gelu_tanh_and_mul_fused,
    example_inputs=(torch.randn(1, 4, 32), torch.randn(1, 4, 32)),  # [1, tokens, features], the graph's rank
    where=same_shape_and_dtype,
)


class FuseGeluTanhAndMul(PatternPass):
    name = "fuse_gelu_tanh_and_mul"
    phase = "fusion"
    patterns = (GELU_TANH_AND_MUL,)
