"""`merge_gate_up`: each MLP's gate and up projections as one GEMM over a concatenated weight.

Before: g = linear(x, Wgate); u = linear(x, Wup)
After:  gu = linear(x, Wgate_up); g, u = the two halves of gu's last dimension (views)
New input: `param:<layer>.mlp.gate_up_proj.weight`, built by the loader from the two
checkpoint tensors (`ConcatWeights` in `ctx.weight_transforms`); `fuse_silu_mul` then
reads the halves in place. Pure layout: on by default on every device. Mixture-of-experts
layers keep their own expert layout (no per-expert linears to merge).
"""

from __future__ import annotations

import torch

from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.merge_linears import merge_pass_uuid, merge_sibling_linears


class MergeGateUpPass(KilnPass):
    name = "merge_gate_up"
    phase = "fusion"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        return merge_sibling_linears(gm, ctx, ("gate_proj", "up_proj"), "gate_up_proj")

    def uuid(self) -> str:
        return merge_pass_uuid(super().uuid())
