"""`prefetch_weights`: each projection names the next one's weight, for its GEMV to bring into L2.

Before: y1 = kiln.linear(x1, W1)            ...norm, RoPE, attention (latency-bound)...
        y2 = kiln.fp8_linear(x2q, x2s, W2, W2_scale, None, bf16)
After:  y1 = kiln.linear(x1, W1, prefetch=W2)
        y2 = kiln.fp8_linear(x2q, x2s, W2, W2_scale, None, bf16, prefetch=<the next weight>)

At decode a step is a chain of GEMVs bound by streaming their weights from HBM, with
latency-bound kernels between them during which HBM idles. With `prefetch`, the CUDA GEMV's
last programs ask L2 for the start of the next projection's weight as they finish
(kiln.kernels.triton_common, `prefetch_l2`), so those bytes cross while the small kernels
run. Results do not change: `prefetch` is a hint the references and cuBLAS paths ignore.

A projection is linked to the next one in graph order only when nothing between them reads
a weight matrix (a parameter of two or more dimensions: an MoE block's experts, a
projection left as `aten.linear`): such a read could stream past L2 and evict the
prefetched bytes, wasting the bandwidth. Norm weights and other vectors do not block.

Phase `logits`, last: after `quantize_fp8` and `use_triton_linear` have given the projections
their final ops. Device policy as for the custom-op fusions (kiln.passes.fuse_common): CUDA
graphs by default, CPU graphs on request (where it changes nothing but the graph).
"""

from __future__ import annotations

import torch

from kiln.compiler.graph_inputs import RoleKind, role_of
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.fuse_common import CudaByDefault


def _param_value(node: object) -> torch.Tensor | None:
    """The example value of a `param:` graph input, None for anything else."""
    if not (isinstance(node, torch.fx.Node) and node.op == "placeholder"):
        return None
    role = role_of(node)
    val = node.meta.get("val")
    if role is None or role.kind is not RoleKind.PARAM or not isinstance(val, torch.Tensor):
        return None
    return val


def _projection_weight(node: torch.fx.Node) -> torch.fx.Node | None:
    """The parameter weight of a `kiln::linear` / `kiln::fp8_linear` call, else None."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.kiln.linear.default:
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    elif node.target is torch.ops.kiln.fp8_linear.default:
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    else:
        return None
    return weight if _param_value(weight) is not None else None


def _reads_weight_matrix(node: torch.fx.Node) -> bool:
    return any((val := _param_value(arg)) is not None and val.dim() >= 2 for arg in node.all_input_nodes)


class PrefetchWeightsPass(CudaByDefault, KilnPass):
    name = "prefetch_weights"
    phase = "logits"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        linked = blocked = 0
        # The last projection and its weight, while nothing since has read a weight matrix.
        previous: tuple[torch.fx.Node, torch.fx.Node] | None = None
        for node in gm.graph.nodes:
            weight = _projection_weight(node)
            if weight is None:
                if previous is not None and _reads_weight_matrix(node):
                    previous = None
                    blocked += 1
                continue
            if previous is not None and previous[1] is not weight:
                previous[0].kwargs = {**previous[0].kwargs, "prefetch": weight}
                linked += 1
            previous = (node, weight)
        return {"prefetch_linked": linked, "prefetch_blocked": blocked}
