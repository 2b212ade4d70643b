"""`fuse_silu_mul`: the gated MLP's `silu(gate) * up` as one `kiln::silu_and_mul` op.

Before: a = silu(gate); y = mul(a, up)        After: y = kiln::silu_and_mul(gate, up)

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


class FuseSiluMulPass(CustomOpFusionPass):
    name = "fuse_silu_mul"
    patterns = (SILU_AND_MUL,)
