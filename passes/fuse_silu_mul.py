"""`fuse_silu_mul`: the gated MLP's `silu(gate) * up` as one `kiln::silu_and_mul` op, and
its GELU-tanh form (Gemma's `gelu_pytorch_tanh`) as `kiln::gelu_tanh_and_mul`.

Before: a = silu(gate); y = mul(a, up)        After: y = kiln::silu_and_mul(gate, up)
Before: a = gelu(gate, approximate="tanh"); y = mul(a, up)
                                              After: y = kiln::gelu_tanh_and_mul(gate, up)
Exact GELU (erf) MLPs are left as they are: their pattern differs in the approximate flag.

After `merge_gate_up`, gate and up are the two halves (slices) of one projection; the
kernel reads them in place. Runs on CUDA graphs by default; see `kiln.passes.fuse_common`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.passes.fuse_common import CustomOpFusionPass
from kiln.passes.pattern import Pattern


def silu_and_mul_pattern(gate, up):
    return F.silu(gate) * up


def silu_and_mul_replacement(gate, up):
    return torch.ops.kiln.silu_and_mul(gate, up)


SILU_AND_MUL = Pattern("silu_and_mul", silu_and_mul_pattern, silu_and_mul_replacement,
                       (torch.randn(1, 4, 32), torch.randn(1, 4, 32)))  # [1, tokens, features]


def gelu_tanh_and_mul_pattern(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_replacement(gate, up):
    return torch.ops.kiln.gelu_tanh_and_mul(gate, up)


GELU_TANH_AND_MUL = Pattern("gelu_tanh_and_mul", gelu_tanh_and_mul_pattern, gelu_tanh_and_mul_replacement,
                            (torch.randn(1, 4, 32), torch.randn(1, 4, 32)))  # [1, tokens, features]


class FuseSiluMulPass(CustomOpFusionPass):
    name = "fuse_silu_mul"
    patterns = (SILU_AND_MUL, GELU_TANH_AND_MUL)
