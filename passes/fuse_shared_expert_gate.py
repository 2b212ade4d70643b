"""`fuse_shared_expert_gate`: a shared expert's sigmoid gate and its sum with the routed
experts, as one `kiln::add_gated_shared_expert` op.

Before: g = linear(hidden, W_gate)          # [T, 1]: Qwen2-MoE's `shared_expert_gate`
        y = out + sigmoid(g) * shared       # out: the routed experts (kiln::fused_moe)
After:  y = kiln::add_gated_shared_expert(out, shared, hidden, W_gate)

Qwen2-MoE, Qwen3-Next and Qwen3.5-MoE blocks end this way. Four launches of a few
microseconds a layer become one (kiln.kernels.triton_shared_expert_gate): at Qwen3-Next-80B's
48 layers, ~150 launches fewer in every decode step. The gate's one-column projection goes
into the op, so `quantize_fp8` never sees it (it would have stayed in the model dtype, as the
routers do). Runs on CUDA graphs by default; see `kiln.passes.fuse_common`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.passes.fuse_common import CustomOpFusionPass
from kiln.passes.pattern import Pattern


def gated_shared_expert_pattern(out, shared, hidden, gate_weight):
    return out + torch.sigmoid(F.linear(hidden, gate_weight)) * shared


def gated_shared_expert_replacement(out, shared, hidden, gate_weight):
    return torch.ops.kiln.add_gated_shared_expert(out, shared, hidden, gate_weight)


ADD_GATED_SHARED_EXPERT = Pattern(
    "add_gated_shared_expert", gated_shared_expert_pattern, gated_shared_expert_replacement,
    (torch.randn(4, 32), torch.randn(4, 32), torch.randn(4, 32), torch.randn(1, 32)))  # [tokens, hidden]


class FuseSharedExpertGatePass(CustomOpFusionPass):
    name = "fuse_shared_expert_gate"
    patterns = (ADD_GATED_SHARED_EXPERT,)
