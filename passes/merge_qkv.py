"""`merge_qkv`: each attention's q, k and v projections as one GEMM over a concatenated weight
(and a gated DeltaNet layer's input projections likewise).

Before: q = linear(x, Wq); k = linear(x, Wk); v = linear(x, Wv)        (+ biases, Qwen2)
After:  qkv = linear(x, Wqkv); q, k, v = slices of qkv's last dimension (views)
New input: `param:<layer>.self_attn.qkv_proj.weight` (and `.bias`), built by the loader
from the three checkpoint tensors (`ConcatWeights` in `ctx.weight_transforms`).

The gated DeltaNet layers' input projections read one input too: Qwen3-Next's
`in_proj_qkvz` and `in_proj_ba` become `in_proj_qkvzba`, Qwen3.5's `in_proj_qkv`, `in_proj_z`,
`in_proj_b` and `in_proj_a` become `in_proj_qkvzba` as well (stats `in_proj_qkvzba_merged`,
present when a group merged). The b/a projections are a few dozen columns each: alone they
are launches that read almost nothing, and the norm before them could not fuse into one
projection (FP8's `fuse_fp8_linear_inputs`) while two or four read its output.

At decode, each projection is a skinny GEMM bound by reading its weight; one launch over
the concatenation reads the same bytes with fewer, fuller kernels. Pure layout: on by
default on every device. See `kiln.passes.merge_linears` for the mechanics.
"""

from __future__ import annotations

import torch

from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.merge_linears import merge_pass_uuid, merge_sibling_linears


# The gated DeltaNet's input projections, in the order their outputs are concatenated.
LINEAR_ATTENTION_INPUTS = (("in_proj_qkvz", "in_proj_ba"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))


class MergeQKVPass(KilnPass):
    name = "merge_qkv"
    phase = "fusion"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        stats = merge_sibling_linears(gm, ctx, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        for members in LINEAR_ATTENTION_INPUTS:
            merged = merge_sibling_linears(gm, ctx, members, "in_proj_qkvzba")
            if merged["in_proj_qkvzba_merged"]:
                stats["in_proj_qkvzba_merged"] = stats.get("in_proj_qkvzba_merged", 0) + merged["in_proj_qkvzba_merged"]
                stats["inputs_added"] += merged["inputs_added"]
        return stats

    def uuid(self) -> str:
        return merge_pass_uuid(super().uuid())
