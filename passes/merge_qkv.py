"""`merge_qkv`: each attention's q, k and v projections as one GEMM over a concatenated weight.

Before: q = linear(x, Wq); k = linear(x, Wk); v = linear(x, Wv)        (+ biases, Qwen2)
After:  qkv = linear(x, Wqkv); q, k, v = slices of qkv's last dimension (views)
New input: `param:<layer>.self_attn.qkv_proj.weight` (and `.bias`), built by the loader
from the three checkpoint tensors (`ConcatWeights` in `ctx.weight_transforms`).

At decode, each projection is a skinny GEMM bound by reading its weight; one launch over
the concatenation reads the same bytes with fewer, fuller kernels. Pure layout: on by
default on every device. See `kiln.passes.merge_linears` for the mechanics.
"""

from __future__ import annotations

import torch

from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.merge_linears import merge_pass_uuid, merge_sibling_linears


class MergeQKVPass(KilnPass):
    name = "merge_qkv"
    phase = "fusion"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        return merge_sibling_linears(gm, ctx, ("q_proj", "k_proj", "v_proj"), "qkv_proj")

    def uuid(self) -> str:
        return merge_pass_uuid(super().uuid())
